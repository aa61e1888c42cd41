"""Data shipped with specserve: Spec-Bench's questions (Xia et al. 2024, Apache-2.0, see LICENSE)."""
