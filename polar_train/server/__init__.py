"""``polar-train serve``: a CPU inference server that speaks vLLM 0.32's wire formats."""
