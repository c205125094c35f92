"""Code every gridserve role uses: config, domain types, errors, Hugging Face file helpers."""
