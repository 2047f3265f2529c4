"""Models: the processor, Qwen3-VL loading with LoRA and arms, the text tower's attention, the offline tiny model."""
