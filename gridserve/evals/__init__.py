"""``gridserve eval``: model quality measured through gridserve, checked against transformers.

- ``models.py`` — what a model argument names (the default SmolLM2 GGUF, ``demo``, a ``.gguf``
  file, a Hugging Face folder) and transformers' loading of the same weights, the reference.
- ``perplexity.py`` — ``gridserve eval perplexity``: held-out perplexity from the offline engine's
  prompt logprobs.
- ``chat.py`` — ``gridserve eval chat``: a fixed question set (``chat_questions.jsonl``) asked
  through a running server's OpenAI API, scored by expected answer patterns.

Nothing here imports ``gridserve.demo`` (left out of the container images) except when the demo
model is asked for by name.
"""
