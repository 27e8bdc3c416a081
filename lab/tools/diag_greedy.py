"""Why a bf16 greedy run with ``sparse_mla`` departs from eager: rounding at a near-tie of
the final logits, or HF's indexer picking other compressed entries (its input, the layers
below, rounds differently), after which the attention itself differs.

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.lab.tools.diag_greedy
      [--topk 4 16] [--seeds 6] [--device cpu]

Per index_topk and seed of the tests' tiny model (batch 2, prompts 30 and 21 tokens, 20
greedy tokens): the first generated step where the two runs' tokens differ per row, eager's
top-2 logit gap there, and the first indexer call (0 = prefill, then one per decode step
and CSA layer) whose picks, as sets, differ between the runs.
"""
import argparse
import sys

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

import sparse_mla.integration.transformers  # noqa: F401  (registers "sparse_mla")
from sparse_mla.integration.transformers import models

PROMPT, PAD, NEW = 30, 9, 20


def _run(model, ids, mask, impl):
    picks = []
    hooks = [m.register_forward_hook(lambda m, a, o: picks.append(o.sort(-1).values.cpu()))
             for m in model.modules() if isinstance(m, hf.DeepseekV4Indexer)]
    model.set_attn_implementation(impl)
    try:
        seq, margins = models.greedy_with_margins(model, ids, mask, NEW)
    finally:
        for h in hooks:
            h.remove()
    return seq[:, PROMPT:], margins, picks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topk", type=int, nargs="+", default=[4, 16])
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    for topk in args.topk:
        for seed in range(args.seeds):
            model = models.random_model(models.tiny_config(index_topk=topk), torch.bfloat16,
                                        device=args.device, seed=seed)
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(3, model.config.vocab_size, (2, PROMPT), generator=g)
            mask = torch.ones(2, PROMPT, dtype=torch.long)
            ids[1, :PAD], mask[1, :PAD] = model.config.pad_token_id, 0
            ids, mask = ids.to(args.device), mask.to(args.device)
            e, margins, e_picks = _run(model, ids, mask, "eager")
            o, _, o_picks = _run(model, ids, mask, "sparse_mla")
            rows = []
            for r in range(2):
                diff = (e[r] != o[r]).nonzero()
                step = int(diff[0]) if len(diff) else None
                rows.append("same" if step is None else
                            f"step {step} (eager gap {float(margins[r, step]):.4f})")
            pick = next((i for i, (a, b) in enumerate(zip(e_picks, o_picks))
                         if a.shape != b.shape or not torch.equal(a, b)), None)
            print(f"topk {topk:>3} seed {seed}: tokens {rows[0]} | {rows[1]}; indexer picks "
                  f"first differ at call {pick} of {len(e_picks)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
