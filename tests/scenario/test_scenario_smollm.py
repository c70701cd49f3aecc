"""The passphrase demo rests on the default model echoing every passphrase it is given: check the
demo's requests with plain greedy `generate` (one request at a time, no kvtui engine involved).

Measured when the word list and prompt were chosen: seed 0's first 40 passphrases 40/40 (the demo uses the
first 8); other seeds about 97-100% (the 135M model sometimes garbles a word or the number).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtui.scenario import load_scenario, plan_requests

pytestmark = pytest.mark.smollm
DEMO = Path(__file__).parents[2] / "scenarios" / "passphrase.yaml"


def test_default_model_echoes_every_demo_passphrase(smollm2):
    scenario = load_scenario(DEMO)
    reqs = plan_requests(scenario, smollm2.tokenizer)
    eos = list(smollm2.eos_token_ids)
    missed = []
    for r in reqs:
        ids = torch.tensor([r.prompt_ids])
        with torch.no_grad():
            out = smollm2.model.generate(ids, max_new_tokens=r.sampling.max_new_tokens, do_sample=False,
                                         eos_token_id=eos, pad_token_id=eos[0])
        text = smollm2.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        if r.passphrase not in text:
            missed.append((r.passphrase, text))
    assert not missed, missed
