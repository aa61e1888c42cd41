"""Training EAGLE / MTP draft heads on hidden states the target precomputes through the inference
engine's own model runner."""
