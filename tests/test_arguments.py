"""Int options are checked one way (revtriton.ops.arguments.checked_int): an int, not a bool (which
Python counts as one) nor a float, within its bounds; the error names the option."""
import pytest
import torch
from torch import nn

from revtriton import Adapter, ReversibleStack
from revtriton.models import rev_vit
from revtriton.ops.arguments import checked_int
from revtriton.ops.linear_cross_entropy import linear_cross_entropy


@pytest.mark.parametrize("value", [True, False, 2.0, "2", None])
def test_only_ints_pass(value):
    with pytest.raises(ValueError, match=r"depth must be an int >= 0, got"):
        checked_int("depth", value, 0)


def test_bounds_and_note():
    assert checked_int("n", 0, 0) == 0 and checked_int("n", 30, 0, 30) == 30
    with pytest.raises(ValueError, match=r"^n must be an int in \[0, 30\], got 31$"):
        checked_int("n", 31, 0, 30)
    with pytest.raises(ValueError, match=r"^n must be an int >= 1 \(or None\), got 0$"):
        checked_int("n", 0, 1, note=" (or None)")


def _block():
    from revtriton import GenericHalf, ReversibleBlock

    return ReversibleBlock(GenericHalf(nn.Linear(4, 4)), GenericHalf(nn.Linear(4, 4)))


@pytest.mark.parametrize("make,name", [
    (lambda: ReversibleStack([_block()], anchor_every=True), "anchor_every"),
    (lambda: ReversibleStack([_block()], frac_bits=True), "frac_bits"),
    (lambda: Adapter(True, 4), "Adapter dim"),
    (lambda: Adapter(4, 2.0), "Adapter size"),
    (lambda: rev_vit("tiny", num_classes=True), "num_classes"),
    (lambda: rev_vit("tiny", depth=True), "depth"),
    (lambda: linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long),
                                  chunk_tokens=True), "chunk_tokens"),
])
def test_every_int_option_refuses_a_bool(make, name):
    with pytest.raises(ValueError, match=rf"{name} must be an int"):
        make()
