"""Synthesis: the stage cost model, A* program search, segments (HAP §3.2, §4)."""
