"""The Pyro patches for ``vmap`` are scoped to their ``with`` block."""

import pyro
import pyro.distributions as dist
import pyro.infer.trace_elbo
import pyro.infer.traceenum_elbo
import pyro.infer.util
import pyro.ops.special
import pyro.poutine.enum_messenger
import pytest
import torch
import torch.distributions.normal
from pyro import poutine

from pyro_pdvi.infer._vmap import vmap_compatible_pyro


def test_patches_are_scoped_and_undone_also_after_an_exception():
    originals = {
        "torch_item": pyro.infer.trace_elbo.torch_item,
        "warn_if_nan": pyro.infer.traceenum_elbo.warn_if_nan,
        "_SafeLog": pyro.ops.special._SafeLog,
        "post_sample": pyro.poutine.enum_messenger.EnumMessenger.__dict__["_pyro_post_sample"],
        "expectation": pyro.infer.util.Dice.__dict__["compute_expectation"],
        "standard_normal": torch.distributions.normal._standard_normal,
    }

    def current():
        return {
            "torch_item": pyro.infer.trace_elbo.torch_item,
            "warn_if_nan": pyro.infer.traceenum_elbo.warn_if_nan,
            "_SafeLog": pyro.ops.special._SafeLog,
            "post_sample": pyro.poutine.enum_messenger.EnumMessenger.__dict__["_pyro_post_sample"],
            "expectation": pyro.infer.util.Dice.__dict__["compute_expectation"],
            "standard_normal": torch.distributions.normal._standard_normal,
        }

    def flags():
        return (
            pyro.infer.util.is_validation_enabled(),
            dist.is_validation_enabled(),
            poutine.util.is_validation_enabled(),
        )

    for validation in (True, False):
        pyro.enable_validation(validation)
        try:
            before = flags()
            with pytest.raises(KeyError, match="inside"):
                with vmap_compatible_pyro():
                    assert flags() == (False, False, False)
                    assert all(current()[k] is not originals[k] for k in originals)
                    # Outside vmap the replacements behave as the originals.
                    assert pyro.infer.trace_elbo.torch_item(torch.tensor(2.5)) == 2.5
                    raise KeyError("inside")
            assert flags() == before
            assert current() == originals
        finally:
            pyro.enable_validation(True)
