import pyro
import pytest
import torch


@pytest.fixture(autouse=True)
def float64_seeded_clean_store():
    """Every test: float64, one thread, a fresh param store and fixed seeds."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    torch.set_default_dtype(dtype)
    pyro.clear_param_store()
