"""What a JSON-schema constraint costs, and what jump-forward saves, end to end on the real model.

    python -m benchmarks.constrained_throughput [--batch 32]

1. Mask cost: the same prompts generated under a JSON schema (jump-forward off, so every token is
   sampled under a mask) and unconstrained for the same number of tokens; output tokens/s of both,
   at batch 1 and at --batch.
2. Jump-forward: a schema with long fixed keys, jump-forward off and on: forward steps, output
   tokens, wall time.
"""

from __future__ import annotations

import argparse
import json
import time

import radixlm
from benchmarks.common import commit, device_line

LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 6,
            "maxItems": 6,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "integer", "maximum": 999999},
        "customer_primary_email_address": {"type": "string", "maxLength": 30},
        "customer_preferred_contact_channel": {"enum": ["email", "phone", "post"]},
        "customer_account_creation_year": {"type": "integer", "minimum": 1990, "maximum": 2030},
    },
    "required": [
        "customer_identification_number", "customer_primary_email_address",
        "customer_preferred_contact_channel", "customer_account_creation_year",
    ],
    "additionalProperties": False,
}  # fmt: skip


def run(engine, prompts, params):
    before = engine.get_stats()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    after = engine.get_stats()
    tokens = sum(len(o["output_ids"]) for o in outs)
    return outs, wall, tokens, after["num_steps"] - before["num_steps"]


def check_json(outs) -> None:
    """Every finished output parses; one cut off by max_new_tokens is reported as length."""
    for o in outs:
        if o["meta_info"]["finish_reason"]["type"] != "length":
            json.loads(o["text"])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    print(f"device: {device_line()}  commit: {commit()}")

    rows = []
    with radixlm.Engine(
        args.model_path, enable_jump_forward=False, disable_radix_cache=True
    ) as eng:
        topics = ["fruits", "rivers", "tools", "birds", "colours", "cities", "games", "metals"]
        prompts = [
            eng.apply_chat_template([{"role": "user", "content": f"List six {t} as JSON."}])
            for t in topics
        ]
        eng.generate(
            prompts[0], {"max_new_tokens": 4, "json_schema": LIST_SCHEMA}
        )  # warm-up, compiles
        for batch in (1, args.batch):
            batch_prompts = (prompts * (batch // len(prompts) + 1))[:batch]
            cons = {
                "max_new_tokens": 200,
                "temperature": 0.8,
                "seed": 1,
                "json_schema": LIST_SCHEMA,
            }
            outs, wall_c, tok_c, _ = run(eng, batch_prompts, cons)
            check_json(outs)
            per_req = max(1, tok_c // batch)
            free = {"max_new_tokens": per_req, "temperature": 0.8, "seed": 1, "ignore_eos": True}
            _, wall_f, tok_f, _ = run(eng, batch_prompts, free)
            rows.append((batch, tok_c / wall_c, tok_f / wall_f))

    jump = {}
    for enabled in (False, True):
        with radixlm.Engine(
            args.model_path, enable_jump_forward=enabled, disable_radix_cache=True
        ) as eng:
            prompts = [
                eng.apply_chat_template(
                    [{"role": "user", "content": f"Customer record {i} as JSON."}]
                )
                for i in range(8)
            ]
            eng.generate(prompts[0], {"max_new_tokens": 4, "json_schema": LONG_KEYS_SCHEMA})
            params = {"max_new_tokens": 160, "temperature": 0, "json_schema": LONG_KEYS_SCHEMA}
            outs, wall, tokens, steps = run(eng, prompts, params)
            check_json(outs)
            jump[enabled] = (wall, tokens, steps, eng.get_stats()["jump_forward_tokens"])

    print(
        "\n| batch | constrained out tok/s | unconstrained out tok/s | ratio |\n|---|---|---|---|"
    )
    for batch, c, f in rows:
        print(f"| {batch} | {c:.1f} | {f:.1f} | {c / f:.2f}x |")
    print(
        "\n| jump-forward | wall s | output tokens | forward steps | tokens jumped |\n|---|---|---|---|---|"
    )
    for enabled in (False, True):
        wall, tokens, steps, jumped = jump[enabled]
        print(f"| {'on' if enabled else 'off'} | {wall:.2f} | {tokens} | {steps} | {jumped} |")
    print(
        f"jump-forward speed-up: {jump[False][0] / jump[True][0]:.2f}x, steps saved: {jump[False][2] - jump[True][2]}"
    )


if __name__ == "__main__":
    main()
