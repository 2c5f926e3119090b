"""Structured outputs as users send them: 50 pydantic models through the real openai client's
`chat.completions.parse` against `edgeinfer serve` (started here, on loopback, stopped by pid), temperature 0,
max_tokens 256. Reports how many parse, how many stop for length, and whether every answer keeps the
schema's key order (top-level and nested objects).

  python -m benchmarks structured.parse [--max-tokens 256] [--out benchmarks/results/structured.parse.json]
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import time
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ValidationError, create_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.results import run_stamp, write_result  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "structured.parse.json"


class Color(enum.StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    street: str
    city: str
    zip_code: str


class Person(BaseModel):
    name: str
    age: int
    email: Optional[str]  # noqa: UP045  (the Optional form people send)


FIELD_KINDS = {"str": str, "int": int, "float": float, "bool": bool, "list_str": list[str], "list_int": list[int],
               "optional_str": Optional[str], "color": Color, "level": Literal["low", "medium", "high"],  # noqa: UP045
               "address": Address, "people": list[Person]}
NAMES = ["title", "name", "country", "score", "count", "price", "rating", "tags", "items", "enabled", "summary",
         "year", "city", "author", "status", "owner", "label", "weight", "priority", "notes"]


def models() -> list[tuple[type[BaseModel], str]]:
    """50 models of the kinds people send: flat, nested, lists, enums, Optional, ints and floats."""
    import random

    rng = random.Random(0)
    kinds = list(FIELD_KINDS)
    topics = ["a city", "a book", "a movie", "a product", "a recipe", "a company", "a planet", "a sports team",
              "a song", "a programming language"]
    out = []
    for i in range(50):
        n = 2 + i % 4
        fields = {}
        for name in rng.sample(NAMES, n):
            fields[name] = (FIELD_KINDS[kinds[(i * 7 + len(fields) * 3) % len(kinds)]], ...)
        out.append((create_model(f"Model{i}", **fields), f"Describe {topics[i % len(topics)]}."))
    return out


def key_order_kept(value, schema_props: dict, defs: dict) -> bool:
    if not isinstance(value, dict):
        return True
    want = [k for k in schema_props if k in value]
    if list(value)[: len(want)] != want:
        return False
    for k, sub in schema_props.items():
        ref = sub.get("$ref") or (sub.get("items") or {}).get("$ref")
        if ref and k in value:
            props = defs[ref.split("/")[-1]].get("properties", {})
            items = value[k] if isinstance(value[k], list) else [value[k]]
            if not all(key_order_kept(x, props, defs) for x in items):
                return False
    return True


def main() -> int:
    import openai

    from tests.support.serve import Serve

    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--models", type=int, default=0, help="only the first N models (0: all 50)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    t0, load0 = time.monotonic(), os.getloadavg()
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="ei-structured-"))
    serve = Serve(home, home, "--no-page-store")
    rows = []
    try:
        serve.wait_for("ready:")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve.port}/v1", api_key="sk-edgeinfer-demo",
                               max_retries=0)
        for model, prompt in models()[:a.models or None]:
            schema = model.model_json_schema()
            row = {"model": model.__name__, "fields": list(schema["properties"]), "prompt": prompt}
            try:
                r = client.chat.completions.parse(model="SmolLM2-135M-Instruct", temperature=0,
                                                  max_tokens=a.max_tokens, response_format=model,
                                                  messages=[{"role": "user", "content": prompt}])
                raw = r.choices[0].message.content
                row.update(outcome="parsed", tokens=r.usage.completion_tokens,
                           key_order=key_order_kept(json.loads(raw), schema["properties"], schema.get("$defs", {})))
            except openai.LengthFinishReasonError as e:
                raw = e.completion.choices[0].message.content or ""
                row.update(outcome="length", tail=raw[-80:])
            except (ValidationError, ValueError, openai.APIError) as e:
                row.update(outcome="error", error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            print(f"{row['model']:>8} {row['outcome']:>7} {row.get('key_order', '')}", flush=True)
    finally:
        serve.stop()
    parsed = [r for r in rows if r["outcome"] == "parsed"]
    result = {"models": len(rows), "parsed": len(parsed), "length": sum(r["outcome"] == "length" for r in rows),
              "errors": sum(r["outcome"] == "error" for r in rows),
              "key_order_kept": sum(bool(r.get("key_order")) for r in parsed), "max_tokens": a.max_tokens,
              "rows": rows, **run_stamp(t0, load0)}
    write_result(result, a.out, echo=False)
    print(json.dumps({k: result[k] for k in ("models", "parsed", "length", "errors", "key_order_kept")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
