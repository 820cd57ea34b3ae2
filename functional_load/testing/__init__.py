"""Test and notebook helpers: tiny, real transformers checkpoints built on disk from configs."""
