"""The vendored FlashMLA-semantics ops run on CPU against hand-computed values, imported as
`sparse_mla` from the external repository (not from any installed wheel or checkout path)."""
import os
import sys
import unittest

import torch

import sparse_mla.ops.flashmla_decode as decode
from sparse_mla.tests.wheels import known_values


class VendoredDecodeTest(unittest.TestCase):
    def test_imported_from_the_external_repository(self):
        self.assertEqual(os.environ["TEST_WORKSPACE"], "downstream")
        external = os.path.join(os.environ["TEST_SRCDIR"], "sparse_mla", "ops", "flashmla_decode")
        self.assertEqual(os.path.dirname(os.path.abspath(decode.__file__)), external)

    def test_op_registered(self):
        self.assertTrue(hasattr(torch.ops.sparse_mla, "flashmla_sparse_decode"))

    def test_decode_known_values(self):
        known_values.check_decode()

    def test_prefill_known_values(self):
        known_values.check_prefill()

    def test_triton_on_cpu_cannot_be_forced(self):
        # forcing an implementation that cannot run here names why (DESIGN: no silent fallback)
        from sparse_mla.ops.common.errors import ImplementationUnavailable
        if torch.cuda.is_available():
            self.skipTest("CPU-only check")
        with self.assertRaises(ImplementationUnavailable):
            known_values.check_decode(impl="triton")


if __name__ == "__main__":
    sys.exit(unittest.main())
