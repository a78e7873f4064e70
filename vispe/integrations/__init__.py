"""Integrations with other libraries (optional extras; each module imports its library lazily).

* :mod:`vispe.integrations.hf` -- any vispe multimodal position scheme in Hugging Face
  ``transformers`` Qwen2-VL / Qwen2.5-VL (``pip install "vispe[hf]"``).
"""
