"""CLI targets for tests: factories returning (model, example_args, example_kwargs), as `fxpar show` takes them."""
import models  # tests/models.py: the loader puts this file's folder on sys.path


def llama():
    """Hugging Face Llama from a tiny config (4 heads, vocabulary 64, batch 2, sequence 8), use_cache=False."""
    return models.build("llama")
