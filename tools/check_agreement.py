"""Top-1 agreement of a SmolLM2 .base file with the recorded reference outputs.

    python tools/check_agreement.py MODEL.base [--reference tests/fixtures/smollm2/reference.json]

Teacher-forced: the prompt plus the reference's 32 greedy tokens are fed in one forward, and the
argmax at each of the 32 generation positions is compared with the reference token. Also reports
how many prompts reproduce the full 32-token greedy continuation when generating freely, and the
largest last-position top-20 logit gap.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from basert.engine.runner import ForwardRequest, ModelRunner

DEFAULT_REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2" / "reference.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE)
    args = parser.parse_args()
    prompts = json.loads(args.reference.read_text())["prompts"]
    runner = ModelRunner(args.model, max_context=1024)
    agree = total = exact = 0
    worst_top20 = 0.0
    rows = []
    for prompt in prompts:
        ids, greedy = prompt["input_ids"], prompt["greedy"]
        seq = runner.new_sequence()
        logits = runner.forward([ForwardRequest(seq, ids + greedy[:-1], logits="all")])[0].copy()
        runner.release(seq)
        predicted = np.argmax(logits[len(ids) - 1:], axis=1)
        matches = int(np.sum(predicted == np.asarray(greedy)))
        top = prompt["last_top20"]
        gap = float(np.max(np.abs(logits[len(ids) - 1][[t["id"] for t in top]] -
                                  np.asarray([t["logit"] for t in top], dtype=np.float32))))
        seq = runner.new_sequence()
        last = runner.forward([ForwardRequest(seq, ids)])[0][0].copy()
        free = []
        for _ in range(len(greedy)):
            free.append(int(np.argmax(last)))
            last = runner.forward([ForwardRequest(seq, [free[-1]])])[0][0].copy()
        runner.release(seq)
        exact += free == greedy
        agree += matches
        total += len(greedy)
        worst_top20 = max(worst_top20, gap)
        rows.append((prompt["name"], matches, len(greedy), free == greedy, gap))
    runner.close()
    print("| prompt | teacher-forced top-1 | free greedy identical | max top-20 gap |")
    print("| --- | ---: | :---: | ---: |")
    for name, matches, n, same, gap in rows:
        print(f"| {name} | {matches}/{n} | {'yes' if same else 'no'} | {gap:.2e} |")
    print(f"\nagreement {agree}/{total} = {agree / total:.1%}; identical continuations {exact}/{len(prompts)}; "
          f"worst top-20 gap {worst_top20:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
