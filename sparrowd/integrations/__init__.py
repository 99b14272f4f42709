"""Where patches meet the tensors they change: ``torch`` (any module or state dict) and, next,
``vllm`` (the engine's worker extension). Each needs its framework; the rest of sparrowd does not."""
