"""The one patch mechanism: what it replaces it puts back exactly, and it never undoes another's patch."""

import pytest
import torch

from megatron_longctx import patching
from megatron_longctx.patching import patch


def _module():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 3)


def test_instance_patch_is_undone_to_the_class_method():
    m = _module()
    x = torch.randn(2, 3)
    want = m(x)
    done = patch(m, "forward", lambda t: t * 0, "zeroes")
    assert torch.equal(m(x), torch.zeros(2, 3)) and done.applied
    assert any("Linear.forward: zeroes" == line for line in patching.active())
    done.undo()
    assert "forward" not in vars(m)
    torch.testing.assert_close(m(x), want, rtol=0, atol=0)
    assert not any(line.startswith("Linear.forward") for line in patching.active())
    done.undo()  # twice: nothing happens


def test_a_patch_on_top_survives_the_undo_of_the_one_below():
    m = _module()
    lower = patch(m, "forward", lambda t: t + 1, "lower")
    upper = patch(m, "forward", lambda t: t + 2, "upper")
    lower.undo()  # not the attribute's value any more: leaves the upper one in place
    assert vars(m)["forward"] is upper.replacement
    upper.undo()  # restores what was there when it was applied: the lower patch
    assert vars(m)["forward"] is lower.replacement
    lower.undo()
    assert "forward" not in vars(m)


def test_class_attribute_is_restored_and_context_manager_undoes():
    class Owner:
        def value(self):
            return 1

    original = Owner.__dict__["value"]
    with patch(Owner, "value", lambda self: 2, "for one call"):
        assert Owner().value() == 2
    assert Owner.__dict__["value"] is original and Owner().value() == 1


def test_refusals_name_what_is_missing():
    with pytest.raises(ValueError, match="give the reason"):
        patch(_module(), "forward", lambda t: t, "")
    with pytest.raises(AttributeError, match="no attribute 'fwd'"):
        patch(_module(), "fwd", lambda t: t, "typo")
