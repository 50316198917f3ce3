"""Real models at their published sizes, built on the meta device, synthesized on ``hap-testbed:8``
(issue 12, acceptance 2): Hugging Face transformers GPT-2 124M, BERT-base (classification and masked
LM), a ~1B Llama, T5-small, ViT-B/16, a small Mixtral, Wav2Vec2-base and HuBERT-base with CTC heads on
padded audio; torchvision ResNet-50, ViT-B/16 and MobileNetV3; timm ViT-B/16. Each is called as its
documentation shows (``model(input_ids=..., labels=...)``, ``model(input_values=..., attention_mask=...,
labels=...)``).

    python benchmarks/realworld.py [--quick] [--json out.json] [--models NAME ...]

Per model: trace, derive and synthesis time (seconds), peak RSS of the worker process, the predicted
step time of hapc's plan and of the DP-EV baseline (even data parallelism) and their ratio. Each model
runs in its own subprocess under a time limit (180 s; ``--quick``: the tiny test configs, 90 s); a
model that times out or fails is reported with the stage it was in and a one-line reason, never
dropped. Nothing is allocated: parameters and inputs are meta tensors (the speech entries' padded batch,
1.5 MB, is made real for its lengths and then moved to meta).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CLUSTER = "hap-testbed:8"
LIMIT_S = {False: 180, True: 90}
#: the program search's time limit (``hapc.synthesize(time_limit=)``) at published sizes: past it
#: the best program found is kept and reported unproven, with its optimality gap
SEARCH_LIMIT_S = {False: 60.0, True: None}

#: name -> (description of the published config, batch, sequence length, image size or audio samples)
FULL: dict[str, tuple[str, int, int]] = {
    "gpt2": ("GPT-2 124M (HF, SDPA)", 8, 1024),
    "bert-cls": ("BERT-base, sequence classification (HF)", 32, 512),
    "bert-mlm": ("BERT-base, masked LM, tied decoder (HF)", 32, 512),
    "llama": ("Llama ~1.1B (HF; TinyLlama shape: 22 layers, 2048 hidden, GQA 32/4)", 4, 2048),
    "t5": ("T5-small (HF, encoder-decoder, labels=)", 32, 512),
    "vit-hf": ("ViT-B/16 224 (HF)", 64, 224),
    "mixtral": ("Mixtral small (HF; 8 layers, 1024 hidden, 8 experts top-2)", 8, 1024),
    "tv-resnet": ("torchvision ResNet-50", 64, 224),
    "tv-vit": ("torchvision ViT-B/16", 64, 224),
    "tv-mobilenet": ("torchvision MobileNetV3-Large", 64, 224),
    "timm-vit": ("timm vit_base_patch16_224", 64, 224),
    "wav2vec2": ("Wav2Vec2-base, CTC, padded audio (HF)", 8, 16000),
    "hubert": ("HuBERT-base, CTC, padded audio (HF)", 8, 16000),
}
#: the libraries each model needs
NEEDS = {
    **{k: "transformers" for k in ("gpt2", "bert-cls", "bert-mlm", "llama", "t5", "vit-hf", "mixtral")},
    "wav2vec2": "transformers",
    "hubert": "transformers",
    "tv-resnet": "torchvision",
    "tv-vit": "torchvision",
    "tv-mobilenet": "torchvision",
    "timm-vit": "timm",
}


def _build_full(name: str) -> tuple[Any, Any]:
    """The published-size model on the meta device and a meta batch (float32)."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import realworld as zoo  # the test zoo: library imports and the WithLoss wrapper

    _, batch, n = FULL[name]

    def ids(b: int, s: int) -> torch.Tensor:
        return torch.zeros(b, s, dtype=torch.long, device="meta")

    def images(classes: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.empty(batch, 3, n, n, device="meta")
        return x, torch.zeros(batch, dtype=torch.long, device="meta")

    def speech() -> dict[str, torch.Tensor]:
        """8 clips of 0.6-1 s zero padded to ``n`` samples with their ``attention_mask``, transcripts of
        9-20 characters padded with -100 (the test zoo's :func:`padded_speech`), moved to meta: the
        program is planned from shapes, and the capture records the same ops for any mask and labels
        (the mask's writes, the CTC's padded targets, the labels' range check)."""
        lengths = [n, 14400, 12000, n, 9600, 15200, 11200, 13600][:batch]
        with torch.device("cpu"):  # made real (the lengths are values), then moved
            real = zoo.padded_speech(lengths, [18, 15, 12, 20, 9, 16, 11, 14][:batch], n, 20, 32)
        return {k: v.to("meta") for k, v in real.items()}

    with torch.device("meta"):
        if name in NEEDS and NEEDS[name] == "transformers":
            t = zoo._hf()
            drop = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
            if name == "gpt2":
                cfg = t.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
                cfg._attn_implementation = "sdpa"
                return t.GPT2LMHeadModel(cfg), dict(input_ids=ids(batch, n), labels=ids(batch, n))
            if name == "bert-cls":
                cfg = t.BertConfig(num_labels=3, **drop)
                return t.BertForSequenceClassification(cfg), dict(
                    input_ids=ids(batch, n), labels=torch.zeros(batch, dtype=torch.long)
                )
            if name == "bert-mlm":
                cfg = t.BertConfig(**drop)
                return t.BertForMaskedLM(cfg), dict(input_ids=ids(batch, n), labels=ids(batch, n))
            if name == "llama":
                cfg = t.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                    num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)  # fmt: skip
                return t.LlamaForCausalLM(cfg), dict(input_ids=ids(batch, n), labels=ids(batch, n))
            if name == "t5":
                cfg = t.T5Config(decoder_start_token_id=0, dropout_rate=0.0)  # defaults are T5-small
                return t.T5ForConditionalGeneration(cfg), dict(input_ids=ids(batch, n), labels=ids(batch, n // 4))
            if name == "vit-hf":
                cfg = t.ViTConfig(num_labels=1000, **drop)  # defaults are ViT-B/16 at 224
                x, y = images(1000)
                return t.ViTForImageClassification(cfg), dict(pixel_values=x, labels=y)
            if name == "mixtral":
                cfg = t.MixtralConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                                      num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                      num_local_experts=8, num_experts_per_tok=2,
                                      experts_implementation="batched_mm")  # fmt: skip
                return t.MixtralForCausalLM(cfg), dict(input_ids=ids(batch, n), labels=ids(batch, n))
            if name in ("wav2vec2", "hubert"):
                # facebook/wav2vec2-base and facebook/hubert-base-ls960 are the configs' defaults (12 layers,
                # 768 hidden, 7 convolutions: 49 frames per second of 16 kHz audio); a character vocabulary
                # of 32 (blank = pad = 0) as their CTC fine-tunes; SpecAugment off (its masks are NumPy
                # draws, which hapc refuses) and every dropout and LayerDrop 0, as the other entries
                config, head = {"wav2vec2": (t.Wav2Vec2Config, t.Wav2Vec2ForCTC),
                                "hubert": (t.HubertConfig, t.HubertForCTC)}[name]  # fmt: skip
                cfg = config(vocab_size=32, mask_time_prob=0.0, hidden_dropout=0.0, activation_dropout=0.0,
                             attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
                             ctc_loss_reduction="mean")  # fmt: skip
                return head(cfg), speech()
        if name in ("tv-resnet", "tv-vit", "tv-mobilenet"):
            tv = zoo.import_torchvision()
            build = {"tv-resnet": tv.models.resnet50, "tv-vit": tv.models.vit_b_16,
                     "tv-mobilenet": lambda: tv.models.mobilenet_v3_large(dropout=0.0)}[name]  # fmt: skip
            return zoo.WithLoss(build()), images(1000)
        if name == "timm-vit":
            zoo.import_torchvision()
            import timm

            return zoo.WithLoss(timm.create_model("vit_base_patch16_224", drop_rate=0.0)), images(1000)
    raise KeyError(name)


def _build_quick(name: str) -> tuple[Any, Any]:
    """The test zoo's tiny config (float32, real tensors), batch 8 (DP-EV needs one sample per device)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import realworld as zoo

    return zoo.MODELS[name][0](batch=8)


def _emit(**kw: Any) -> None:
    print("@@" + json.dumps(kw), flush=True)


def worker(name: str, quick: bool) -> None:
    """Measure one model, printing each stage's result as it finishes (a timeout keeps the finished ones)."""
    import torch

    import hapc
    from hapc.api import synthesize_theory
    from hapc.cluster import Cluster

    torch.set_num_threads(1)
    cluster = Cluster.load(CLUSTER)
    _emit(stage="build")
    model, inputs = (_build_quick if quick else _build_full)(name)
    _emit(stage="trace")
    t0 = time.perf_counter()
    graph = hapc.trace(model, inputs)
    t1 = time.perf_counter()
    _emit(stage="derive", trace_s=t1 - t0, nodes=len(graph), params_M=graph.param_count() / 1e6)
    theory = hapc.derive(graph)
    t2 = time.perf_counter()
    _emit(stage="synthesis", derive_s=t2 - t1)
    plan = synthesize_theory(theory, cluster, time_limit=SEARCH_LIMIT_S[quick])
    t3 = time.perf_counter()
    _emit(stage="dp-ev", synthesis_s=t3 - t2, hapc_ms=plan.time * 1e3, search_s=plan.timings.get("search"),
          lp_s=plan.timings.get("lp"), proven=plan.predicted["proven_optimal"],
          gap=plan.predicted["optimality_gap"])  # fmt: skip
    try:
        base = synthesize_theory(theory, cluster, baseline="dp-ev")
    except hapc.HapcError as e:  # DP-EV does not apply (a batch smaller than the device count)
        base, note = None, str(e).split(";")[0]
    t4 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    if base is None:
        _emit(stage="done", dpev_note=note, dpev_s=t4 - t3, rss_MB=rss)
    else:
        _emit(stage="done", dpev_ms=base.time * 1e3, dpev_s=t4 - t3, rss_MB=rss)


def measure(name: str, quick: bool) -> dict[str, Any]:
    """Run :func:`worker` for ``name`` in a subprocess under the time limit; the row it left."""
    limit = LIMIT_S[quick]
    row: dict[str, Any] = {"model": FULL[name][0] if not quick else f"{name} (tiny)"}
    row["batch"], row["size"] = (8, "tiny") if quick else FULL[name][1:]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name] + (["--quick"] if quick else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = "", None
    row["wall_s"] = time.perf_counter() - t0
    for line in out.splitlines():
        if line.startswith("@@"):
            row.update(json.loads(line[2:]))
    if rc is None:
        row["status"] = f"timed out after {limit} s in {row.get('stage', 'start')}"
    elif rc != 0 or row.get("stage") != "done":
        last = [ln for ln in err.strip().splitlines() if ln.strip()]
        reason = last[-1] if last else f"exit {rc}"
        row["status"] = f"failed in {row.get('stage', 'start')}: {reason[:300]}"
    else:
        row["status"] = "ok" if "dpev_note" not in row else f"ok; DP-EV n/a: {row['dpev_note']}"
        row["ratio"] = row["dpev_ms"] / row["hapc_ms"] if row.get("dpev_ms") and row["hapc_ms"] else None
    return row


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run(quick: bool = False, names: list[str] | None = None) -> dict[str, Any]:
    """Every model of :data:`FULL` (or ``names``), each measured in its own subprocess."""
    rows: dict[str, Any] = {}
    for name in names or FULL:
        if not _has(NEEDS[name]):
            rows[name] = {"model": FULL[name][0], "status": f"skipped: {NEEDS[name]} is not installed"}
            continue
        rows[name] = measure(name, quick)
        print(name, rows[name]["status"], flush=True, file=sys.stderr)
    return {"quick": quick, "cluster": CLUSTER, "limit_s": LIMIT_S[quick], "search_limit_s": SEARCH_LIMIT_S[quick],
            "rows": rows}  # fmt: skip


def _f(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "–"


def _optimal(row: dict[str, Any]) -> str:
    if "proven" not in row:
        return "–"
    return "yes" if row["proven"] else f"within {row['gap']:.3g}x"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"### Real models on {result['cluster']} (meta device, float32)",
        "",
        f"Each model in its own process, limit {result['limit_s']} s; seconds per stage, predicted step time (ms) "
        "of hapc's plan and of DP-EV, DP-EV / hapc (>1: hapc is faster). Batch: samples per step; size: "
        "sequence length, image side or audio samples. Optimal: the program search proved its program optimal "
        "(yes), or "
        f"its time limit ({result.get('search_limit_s')} s, `hapc.synthesize(time_limit=)`) stopped it and the "
        "program is at most the factor shown above the optimum at the ratios searched.",
        "",
        "| model | batch | size | params (M) | nodes | trace | derive | synthesis | peak RSS (MB) | hapc (ms) "
        "| DP-EV (ms) | DP-EV / hapc | optimal | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"].values():
        lines.append(
            f"| {r['model']} | {r.get('batch', '–')} | {r.get('size', '–')} | {_f(r.get('params_M'), '.0f')} "
            f"| {r.get('nodes', '–')} | {_f(r.get('trace_s'), '.2f')} | {_f(r.get('derive_s'), '.2f')} "
            f"| {_f(r.get('synthesis_s'), '.2f')} | {_f(r.get('rss_MB'), '.0f')} | {_f(r.get('hapc_ms'), '.3g')} "
            f"| {_f(r.get('dpev_ms'), '.3g')} | {_f(r.get('ratio'), '.2f')} | {_optimal(r)} | {r['status']} |"
        )
    return "\n".join(lines + [""])


def main() -> None:
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1], "--quick" in sys.argv)
        return
    import argparse

    import _cli

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the tiny test configs, 90 s each (the CI smoke run)")
    ap.add_argument("--json", help="write results here (default: realworld.json beside the script)")
    ap.add_argument("--models", nargs="*", choices=list(FULL), help="only these models")
    args = ap.parse_args()
    result = run(args.quick, args.models)
    print(markdown(result))
    _cli.save("realworld", result, args)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
