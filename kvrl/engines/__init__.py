"""Rollout engines: hf (the reference decode loop) and vllm (the production plugin)."""
