"""Strict test doubles of libraries that cannot be installed here (tensorrt, tensorrt_llm).

They are installed into sys.modules only by fixtures (tests/contract/conftest.py), never globally.
"""
