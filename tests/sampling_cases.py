"""Sampling settings shared by the sampler's tests and the fused sampling kernel's tests."""

from __future__ import annotations

from radixlm.protocol.sampling_params import SamplingParams

# every filter alone and together; the first six are what the torch sampler's tests check
SETTINGS = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, min_p=0.05),
    dict(temperature=1.0, top_k=20, top_p=0.5, min_p=0.01),
    dict(temperature=2.0, top_p=0.99),
    dict(temperature=0.5, top_k=300),
    dict(temperature=3.0, min_p=0.3, top_k=50),
    dict(temperature=1.5, top_p=0.95, top_k=100),
]


def params(**kw) -> SamplingParams:
    return SamplingParams.from_dict({"max_new_tokens": 4, **kw})
