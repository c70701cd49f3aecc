"""Does vLLM's prefix cache tell apart two chat prompts that differ only in which positions are text?

vLLM (with --enable-prompt-embeds) accepts chat content parts {"type": "prompt_embeds", "data": B64}
between text parts. The renderer turns the prompt into three aligned things: token ids (a placeholder
id at every embedding position), one full-length embedding tensor (the supplied rows at embedding
positions, zeros at text positions) and a mask `prompt_is_token_ids` (True at text positions). The
engine reads the embedding table at True positions and the supplied rows at False ones. Its prefix
cache keys each block by the token ids, with the placeholder positions written as id 0, plus a sha256
of the block's rows of the tensor, but not by the mask.

This probe sends two chat requests built so that those keys are equal while the model's inputs are
not:

    A: [text T] [prompt_embeds: M rows of zeros] [prompt_embeds: F]
    B: [text T + "\\n" + "<|endoftext|>" * M] [prompt_embeds: F]

The parts of a message are joined with "\\n", so both render as
    <system> <|im_start|>user\\n T \\n  [M positions]  \\n [F positions] <|im_end|>\\n<|im_start|>assistant\\n
In A the M positions are embedding positions: ids read as 0, tensor rows zero, mask False, and the
model sees zero vectors. In B they are text: `<|endoftext|>` is token id 0 in SmolLM2's vocabulary,
the tensor holds zeros at text positions, mask True, and the model sees token 0's embedding row.
F is the embedding-table rows of a question, the same in both, at the same positions. Equal ids and
equal tensor in every block, so equal block hashes; different inputs, so different KV.

Runs, greedy, max_tokens 16, logprobs, each with `cache_salt` to pick which cache entries it can see:
    1. B alone (a salt of its own, nothing cached under it)
    2. A (salt S)
    3. B after A (salt S): reuses A's blocks if the key misses the mask
    4. A again (salt S): a control, a legitimate hit on A's own blocks
    5. B again (B alone's salt): a control, a legitimate hit on B's own blocks
and, unless --no-oracle, A's and B's tokens from transformers' own greedy `generate(inputs_embeds=...)`
on the same float32 weights, loaded here apart from the server.

Usage (a server started by scripts/serve-vllm-cpu.sh ... -- --enable-prompt-embeds --block-size 32):
    OMP_NUM_THREADS=1 python scripts/vllm_prompt_embeds_probe.py --url http://127.0.0.1:8011
Options: --model DIR (default kvtui's converted SmolLM2), --served-model-name, --zeros M, --question,
--max-tokens, --json (one JSON object on stdout instead of the report). Exit 0 when the runs were made
(whatever they show), 2 when the server refused or did not answer.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLACEHOLDER = "<prompt_embeds>"  # vLLM's splice token (vllm/renderers/chat_utils.py)
ZERO_TOKEN = "<|endoftext|>"  # id 0 in SmolLM2's vocabulary: the id vLLM writes at embedding positions
DEFAULT_TEXT = "Here is a note:"
DEFAULT_QUESTION = "Repeat the note above exactly."
DEFAULT_ZEROS = 24


def default_model_dir() -> Path:
    from kvtui.models.default import DEFAULT_GGUF_SHA256, DEFAULT_MODEL_ID, cache_dir

    return cache_dir() / f"{DEFAULT_MODEL_ID}-{DEFAULT_GGUF_SHA256[:12]}"


def tensor_b64(t) -> str:
    import torch

    buf = io.BytesIO()
    torch.save(t.contiguous(), buf)
    return base64.b64encode(buf.getvalue()).decode()


@dataclass
class Pair:
    """The two requests' message content and what vLLM will make of them (computed here)."""

    content_a: list[dict]
    content_b: list[dict]
    ids_a: list[int]  # as vLLM hashes them: text ids, 0 at embedding positions
    ids_b: list[int]
    mask_a: list[bool]  # prompt_is_token_ids
    mask_b: list[bool]
    embeds_a: object  # full-length tensor as vLLM builds it
    embeds_b: object
    inputs_a: object  # what the model sees: (n, hidden), table rows at text positions, supplied rows elsewhere
    inputs_b: object
    zero_span: tuple[int, int]  # [start, end) of the M positions that differ
    extra: dict = field(default_factory=dict)


def render(tokenizer, parts: list[tuple[str, object]], placeholder_id: int, table):
    """vLLM's chat rendering for one user message, done locally: parts joined by "\\n", one placeholder
    per prompt_embeds part, the chat template, tokenized, each placeholder expanded to its rows; then
    (hash ids, mask, full tensor, model inputs)."""
    import torch

    text = "\n".join(PLACEHOLDER if kind == "embeds" else value for kind, value in parts)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    tensors = [value for kind, value in parts if kind == "embeds"]
    if ids.count(placeholder_id) != len(tensors):
        raise RuntimeError(f"{ids.count(placeholder_id)} placeholders rendered for {len(tensors)} embeds parts")
    hidden = table.shape[1]
    out_ids, mask, rows, inputs = [], [], [], []
    it = iter(tensors)
    for t in ids:
        if t == placeholder_id:
            e = next(it)
            out_ids += [0] * e.shape[0]
            mask += [False] * e.shape[0]
            rows.append(e)
            inputs.append(e)
        else:
            out_ids.append(t)
            mask.append(True)
            rows.append(torch.zeros(1, hidden, dtype=table.dtype))
            inputs.append(table[t:t + 1])
    return out_ids, mask, torch.cat(rows), torch.cat(inputs)


def build_pair(tokenizer, table, *, zeros: int, text: str, question: str) -> Pair:
    import torch

    tokenizer.add_special_tokens({"additional_special_tokens": [PLACEHOLDER]})
    placeholder_id = tokenizer.convert_tokens_to_ids(PLACEHOLDER)
    zero_id = tokenizer.convert_tokens_to_ids(ZERO_TOKEN)
    if zero_id != 0:
        raise RuntimeError(f"{ZERO_TOKEN} is id {zero_id} in this tokenizer, not 0: the pair needs id 0")
    q_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    f = table[q_ids].clone()
    z = torch.zeros(zeros, table.shape[1], dtype=table.dtype)
    parts_a = [("text", text), ("embeds", z), ("embeds", f)]
    parts_b = [("text", text + "\n" + ZERO_TOKEN * zeros), ("embeds", f)]
    ids_a, mask_a, emb_a, inputs_a = render(tokenizer, parts_a, placeholder_id, table)
    ids_b, mask_b, emb_b, inputs_b = render(tokenizer, parts_b, placeholder_id, table)
    diff = [i for i, (x, y) in enumerate(zip(mask_a, mask_b)) if x != y]
    b64 = {id(z): tensor_b64(z), id(f): tensor_b64(f)}

    def content(parts):
        return [{"type": "text", "text": v} if k == "text" else {"type": "prompt_embeds", "data": b64[id(v)]}
                for k, v in parts]

    return Pair(content(parts_a), content(parts_b), ids_a, ids_b, mask_a, mask_b, emb_a, emb_b, inputs_a, inputs_b,
                (diff[0], diff[-1] + 1) if diff else (0, 0),
                {"question_tokens": len(q_ids), "placeholder_id": placeholder_id})


def oracle_tokens(model, inputs_embeds, max_tokens: int) -> list[int]:
    """transformers' own greedy continuation of B's exact inputs."""
    import torch

    with torch.no_grad():
        out = model.generate(inputs_embeds=inputs_embeds[None], attention_mask=torch.ones(
            1, inputs_embeds.shape[0], dtype=torch.long), max_new_tokens=max_tokens, do_sample=False,
            pad_token_id=model.config.eos_token_id)
    return out[0].tolist()


def chat(client: httpx.Client, url: str, model: str, content: list[dict], salt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, "cache_salt": salt, "return_token_ids": True, "logprobs": True}
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
    j = r.json()
    ch = j["choices"][0]
    details = (j.get("usage") or {}).get("prompt_tokens_details") or {}
    logprobs = [round(c["logprob"], 4) for c in ((ch.get("logprobs") or {}).get("content") or [])]
    return {"tokens": ch.get("token_ids"), "logprobs": logprobs, "text": ch["message"]["content"],
            "finish_reason": ch.get("finish_reason"), "prompt_tokens": j["usage"]["prompt_tokens"],
            "cached_tokens": details.get("cached_tokens"), "prompt_token_ids": j.get("prompt_token_ids"),
            "seconds": round(time.perf_counter() - t0, 2)}


def probe(url: str, *, model_dir: Path, served_name: str, zeros: int = DEFAULT_ZEROS, text: str = DEFAULT_TEXT,
          question: str = DEFAULT_QUESTION, max_tokens: int = 16, oracle: bool = True,
          block_size: int | None = None, timeout: float = 600.0) -> dict:
    """Build the pair, run B alone / A / B after A / A again against `url`, and return every figure."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    table = model.get_input_embeddings().weight.detach()
    pair = build_pair(tokenizer, table, zeros=zeros, text=text, question=question)
    n = len(pair.ids_a)
    same_ids = pair.ids_a == pair.ids_b
    same_tensor = bool(torch.equal(pair.embeds_a, pair.embeds_b))
    result: dict = {
        "url": url, "model_dir": str(model_dir), "prompt_tokens": n, "zeros": zeros,
        "zero_span": list(pair.zero_span), "same_hash_ids": same_ids, "same_tensor": same_tensor,
        "mask_differs_at": sum(a != b for a, b in zip(pair.mask_a, pair.mask_b)),
        "block_size": block_size, **pair.extra,
    }
    if block_size:
        result["full_blocks"] = (n - 1) // block_size  # vLLM never serves a prompt's last token from cache
    run_id = uuid.uuid4().hex[:8]
    salt_alone, salt_shared = f"probe-{run_id}-b-alone", f"probe-{run_id}-shared"
    with httpx.Client(timeout=timeout) as client:
        runs = {
            "b_alone": chat(client, url, served_name, pair.content_b, salt_alone, max_tokens),
            "a": chat(client, url, served_name, pair.content_a, salt_shared, max_tokens),
            "b_after_a": chat(client, url, served_name, pair.content_b, salt_shared, max_tokens),
            "a_again": chat(client, url, served_name, pair.content_a, salt_shared, max_tokens),
            "b_again": chat(client, url, served_name, pair.content_b, salt_alone, max_tokens),
        }
    result["runs"] = runs
    for name, run in runs.items():
        if run["prompt_tokens"] != n:
            result.setdefault("warnings", []).append(f"{name}: server counted {run['prompt_tokens']} prompt "
                                                     f"tokens, the local rendering {n}")
    if oracle:
        result["oracle_b"] = oracle_tokens(model, pair.inputs_b, max_tokens)
        result["oracle_b_text"] = tokenizer.decode(result["oracle_b"])
        result["b_alone_matches_oracle"] = runs["b_alone"]["tokens"] == result["oracle_b"]
        result["oracle_a"] = oracle_tokens(model, pair.inputs_a, max_tokens)
        result["oracle_a_text"] = tokenizer.decode(result["oracle_a"])
        result["a_matches_oracle"] = runs["a"]["tokens"] == result["oracle_a"]
    result["b_after_a_differs"] = runs["b_after_a"]["tokens"] != runs["b_alone"]["tokens"]
    result["b_after_a_equals_a"] = runs["b_after_a"]["tokens"] == runs["a"]["tokens"]
    return result


def report(r: dict) -> str:
    runs = r["runs"]
    lines = [
        f"prompt: {r['prompt_tokens']} tokens; positions {r['zero_span'][0]}-{r['zero_span'][1] - 1} "
        f"({r['zeros']}) are zero-vector embeddings in A and token 0 ({ZERO_TOKEN}) text in B",
        f"same ids as hashed: {r['same_hash_ids']}; same tensor: {r['same_tensor']}; "
        f"mask differs at {r['mask_differs_at']} positions"
        + (f"; block size {r['block_size']}, {r['full_blocks']} cacheable full blocks" if r.get("block_size") else ""),
    ]
    for name in ("b_alone", "a", "b_after_a", "a_again", "b_again"):
        run = runs[name]
        lines.append(f"{name:10s} cached {run['cached_tokens']!s:>4} of {run['prompt_tokens']}  "
                     f"{run['tokens']}  {run['text']!r}  ({run['seconds']} s)")
        lines.append(f"{'':10s} logprobs {run['logprobs'][:4]}")
    if "oracle_b" in r:
        lines.append(f"{'oracle B':10s} (transformers generate, float32)  {r['oracle_b']}  {r['oracle_b_text']!r}")
        lines.append(f"{'oracle A':10s} (transformers generate, float32)  {r['oracle_a']}  {r['oracle_a_text']!r}")
        lines.append(f"B alone matches oracle B: {r['b_alone_matches_oracle']}; "
                     f"A matches oracle A: {r['a_matches_oracle']}")
    verdict = ("B after A reused A's cache and answered differently from B alone: the cache key misses the mask"
               if r["b_after_a_differs"] and (runs["b_after_a"]["cached_tokens"] or 0) > 0
               else "B after A answered as B alone")
    lines.append(verdict)
    lines += [f"warning: {w}" for w in r.get("warnings", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8011")
    p.add_argument("--model", type=Path, default=None, help="HF model folder (default: kvtui's converted SmolLM2)")
    p.add_argument("--served-model-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--zeros", type=int, default=DEFAULT_ZEROS, help=f"M, the positions that differ (default {DEFAULT_ZEROS})")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--question", default=DEFAULT_QUESTION)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=None, help="the server's block size, for the report")
    p.add_argument("--no-oracle", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        r = probe(a.url.rstrip("/"), model_dir=a.model or default_model_dir(), served_name=a.served_model_name,
                  zeros=a.zeros, text=a.text, question=a.question, max_tokens=a.max_tokens,
                  oracle=not a.no_oracle, block_size=a.block_size)
    except (httpx.HTTPError, RuntimeError) as e:
        print(f"vllm_prompt_embeds_probe: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=1) if a.json else report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
