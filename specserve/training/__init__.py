"""Training EAGLE / MTP draft heads on hidden states the target precomputes (SEED section 6)."""
