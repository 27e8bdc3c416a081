"""A ``LaunchPlan`` names the file that holds its route's kernel, so a reader goes from
``dispatch.last_choice(op)`` / ``explain`` straight to the code (pure Python, no kernel)."""
import os

import pytest

import sparse_mla
from sparse_mla.ops.attention import plan

ROOT = os.path.dirname(os.path.abspath(sparse_mla.__file__))


@pytest.mark.parametrize("route", plan.ROUTES)
def test_every_route_names_its_kernel_file(route):
    p = plan.LaunchPlan(route, "a reason", phases=((0, 3, 2),))
    assert p.kernel_file in str(p) and "a reason" in str(p)
    path = os.path.join(ROOT, p.kernel_file)
    assert os.path.isfile(path), path
    with open(path) as f:
        source = f.read()
    # the file holds the split kernel the route launches
    kernel = "sm90_kernel" if route.startswith("sm90") else "_split_kernel"
    assert f"def {kernel}(" in source


def test_every_route_has_a_kernel_file():
    assert set(plan.KERNEL_FILES) == set(plan.ROUTES)
