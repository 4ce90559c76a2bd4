"""First tries on real pixels: small real objects decide the label among look-alike
distractors, on real photographic backgrounds, in photos of mixed sizes, as JPEGs in class
folders. Each scenario is trained exactly as the README says, with no flag but --epochs:

    ats make-dataset from-folder FOLDER DATA --test 0.3 --val 0.1
    ats train DATA --out RUN --epochs E
    ats predict DATA --model RUN/best.pt

Usage:
    python benchmarks/real_pixels.py OUT [--epochs 15] [--scenarios digits,faces,cat-cup,coins]
        [--seed 0] [--images 240] [--make-only] [--set KEY=VALUE ... --run NAME]

``--set KEY=VALUE`` (repeatable) passes a setting to ``ats train`` (``--set patch_loss=0``): a
comparison against the defaults, its run written to OUT/SCENARIO/NAME (``--run``; default
``run``), beside the default's on the same photos and split.

Writes OUT/SCENARIO/{photos,data,run} and prints one table row per scenario: test accuracy,
the epoch it was reached, the attention's entropy per epoch against its uniform value, and
the wall time; before it, one line of val and train accuracy, entropy / uniform and
``attention_moved`` (KL from the attention's start) per epoch: train accuracy climbing while
val stays shows fitting by heart, an attention that moves yet leaves val at chance one that
found no label object. Every picture comes from real photographs that ship with scikit-image (its
bundled photos and its 200 LFW crops) and from the real MNIST digits in sample_data/; the
generator draws sizes, positions and distractors from ``--seed``.

Scenarios (class 0 vs class 1; each image holds 1-2 objects of its class among 3-5
distractors of a third kind, on a crop of a textured photo):
- digits: MNIST "1" vs "7" among other digits, on grass, gravel, brick;
- faces: LFW faces vs LFW non-face crops, among crops of other photos;
- cat-cup: the cat's face (chelsea) vs the coffee cup (coffee), among crops of astronaut,
  rocket, horse, camera;
- coins: coins (coins) vs cells (cell) on immunohistochemistry tissue, among
  crops of the hubble deep field.

And ``cat-coffee``, the everyday case: crops of the cat photo (chelsea) and of the coffee
photo (coffee), each upscaled to its own size around 1300x870 (``--images 40``: 28 sizes
or more), the class the photo's subject: what images of many sizes in one batch are for.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("digits", "faces", "cat-cup", "coins")
EVERYDAY = "cat-coffee"  # not a small-object task: whole photos of two kinds, in many sizes


def _photo(name: str) -> np.ndarray:
    """A bundled scikit-image photo as uint8 RGB [H, W, 3]."""
    import skimage.data as sd

    img = np.asarray(getattr(sd, name)())
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    return img[..., :3].astype(np.uint8)


def _resize(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    return np.asarray(Image.fromarray(img).resize((size[1], size[0]), Image.BILINEAR))


def _crops(img: np.ndarray, rng: np.random.Generator, n: int, side: int) -> list[np.ndarray]:
    h, w = img.shape[:2]
    out = []
    for _ in range(n):
        y, x = rng.integers(0, h - side), rng.integers(0, w - side)
        out.append(img[y:y + side, x:x + side])
    return out


class Pools:
    """Objects of class 0, class 1, distractors and backgrounds for one scenario."""

    def __init__(self, scenario: str, rng: np.random.Generator):
        self.alpha = False  # objects pasted with their dark pixels transparent (digits)
        if scenario == "digits":
            z = np.load(ROOT / "sample_data" / "mnist_digits.npz")
            x, y = z["x_train"], z["y_train"]
            rgb = lambda a: np.repeat(a[..., None], 3, axis=2)  # noqa: E731
            self.a = [rgb(d) for d in x[y == 1][:300]]
            self.b = [rgb(d) for d in x[y == 7][:300]]
            self.d = [rgb(d) for d in x[(y != 1) & (y != 7)][:600]]
            self.backgrounds = [_photo(n) for n in ("grass", "gravel", "brick")]
            self.alpha = True
        elif scenario == "faces":
            import skimage.data as sd

            lfw = (np.asarray(sd.lfw_subset()) * 255).astype(np.uint8)
            rgb = lambda a: np.repeat(a[..., None], 3, axis=2)  # noqa: E731
            self.a = [rgb(f) for f in lfw[:100]]
            self.b = [rgb(f) for f in lfw[100:]]
            others = [_photo(n) for n in ("astronaut", "rocket", "horse", "coffee", "chelsea")]
            self.d = [c for o in others for c in _crops(o, rng, 60, 48)]
            self.backgrounds = [_photo(n) for n in ("grass", "gravel", "brick", "camera")]
        elif scenario == "cat-cup":
            cat, coffee = _photo("chelsea"), _photo("coffee")
            self.a = [cat[40:200, 100:300]]  # the cat's face
            self.b = [coffee[20:240, 190:500]]  # the cup and saucer
            others = [_photo(n) for n in ("astronaut", "rocket", "horse", "camera")]
            self.d = [c for o in others for c in _crops(o, rng, 60, 160)]
            self.backgrounds = [_photo(n) for n in ("grass", "gravel", "brick")]
        elif scenario == "coins":
            coins, cell = _photo("coins"), _photo("cell")
            self.a = [coins[y:y + 70, x:x + 70] for y, x in ((20, 30), (20, 110), (20, 190), (100, 30), (100, 110),
                                                                (180, 30), (180, 110), (250, 30))]
            self.b = _crops(cell, rng, 40, 70)
            self.d = _crops(_photo("hubble_deep_field"), rng, 80, 70)
            self.backgrounds = [_photo("immunohistochemistry")]
        else:
            raise SystemExit(f"unknown scenario {scenario!r}; choose from {', '.join((*SCENARIOS, EVERYDAY))}")


def _paste(canvas: np.ndarray, obj: np.ndarray, side: int, rng: np.random.Generator, alpha: bool,
           taken: list[tuple[int, int]]) -> tuple[int, int]:
    h, w = canvas.shape[:2]
    o = _resize(obj, (side, side))
    if rng.random() < 0.5:
        o = o[:, ::-1]
    for _ in range(50):  # objects do not overlap
        y, x = int(rng.integers(0, h - side)), int(rng.integers(0, w - side))
        if all(abs(y - ty) > side or abs(x - tx) > side for ty, tx in taken):
            break
    taken.append((y, x))
    region = canvas[y:y + side, x:x + side].astype(np.float32)
    if alpha:
        m = o.astype(np.float32).max(axis=2, keepdims=True) / 255.0
        region = region * (1 - m) + o.astype(np.float32) * m
    else:
        region = o.astype(np.float32)
    canvas[y:y + side, x:x + side] = region.astype(np.uint8)
    return y, x


def make_photos(scenario: str, out: Path, n: int, seed: int, size: int = 0) -> None:
    """``n`` JPEGs, half per class, of mixed sizes (500-1100 px a side, aspect 0.6-1.6; all
    ``size`` x ``size`` when given), and ``boxes.json``: each photo's objects (y, x, side, role)."""
    rng = np.random.default_rng(seed)
    boxes: dict[str, list] = {}
    pools = Pools(scenario, rng)
    for label in ("a", "b"):
        (out / label).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        label, objects = (("a", pools.a), ("b", pools.b))[i % 2]
        h = int(rng.integers(500, 1101))
        w = int(np.clip(h * rng.uniform(0.6, 1.6), 500, 1400))
        if size:
            h = w = size
        bg = pools.backgrounds[int(rng.integers(len(pools.backgrounds)))]
        crop = min(bg.shape[0], bg.shape[1]) * rng.uniform(0.6, 1.0)
        y0 = int(rng.integers(0, bg.shape[0] - int(crop) + 1))
        x0 = int(rng.integers(0, bg.shape[1] - int(crop) + 1))
        canvas = _resize(bg[y0:y0 + int(crop), x0:x0 + int(crop)], (h, w)).copy()
        side = int(rng.integers(40, 61))  # objects of 40-60 px in 500-1400 px photos
        taken: list[tuple[int, int]] = []
        found = []
        for _ in range(int(rng.integers(1, 3))):
            found.append((*_paste(canvas, objects[int(rng.integers(len(objects)))], side, rng, pools.alpha, taken),
                          side, "object"))
        for _ in range(int(rng.integers(3, 6))):
            found.append((*_paste(canvas, pools.d[int(rng.integers(len(pools.d)))], side, rng, pools.alpha, taken),
                          side, "distractor"))
        Image.fromarray(canvas).save(out / label / f"{i:04d}.jpg", quality=90)
        boxes[f"{label}/{i:04d}.jpg"] = found
    (out / "boxes.json").write_text(json.dumps(boxes))


def make_everyday(out: Path, n: int, seed: int, square: int = 0) -> None:
    """``n`` JPEGs, half crops of the cat photo, half of the coffee photo, each of its own size
    (all ``square`` x ``square`` when given: the same crops at one size)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        label, name = (("cat", "chelsea"), ("coffee", "coffee"))[i % 2]
        photo = _photo(name)
        ph, pw = photo.shape[:2]
        ch, cw = int(ph * rng.uniform(0.6, 1.0)), int(pw * rng.uniform(0.6, 1.0))
        y, x = int(rng.integers(0, ph - ch + 1)), int(rng.integers(0, pw - cw + 1))
        size = (int(rng.integers(750, 1000)), int(rng.integers(1100, 1500)))
        size = (square, square) if square else size
        (out / label).mkdir(parents=True, exist_ok=True)
        Image.fromarray(_resize(photo[y:y + ch, x:x + cw], size)).save(out / label / f"{i:04d}.jpg", quality=90)


def _ats(*args: str) -> str:
    cmd = [sys.executable, "-m", "ats_cli", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def run(scenario: str, out: Path, epochs: int, images: int, seed: int, make_only: bool, size: int = 0,
        settings: tuple[str, ...] = (), name: str = "run") -> dict:
    base = out / scenario
    photos, data, run_dir = base / "photos", base / "data", base / name
    if not photos.exists() and scenario == EVERYDAY:
        make_everyday(photos, images, seed, size)
    elif not photos.exists():
        make_photos(scenario, photos, images, seed, size)
    if not (data / "dataset.json").exists():
        _ats("make-dataset", "from-folder", str(photos), str(data), "--test", "0.3", "--val", "0.1")
    if make_only:
        return {}
    t0 = time.time()
    given = [arg for kv in settings for arg in ("--set", kv)]
    log, preds = ("train.log", "preds.csv") if name == "run" else (f"{name}.log", f"{name}-preds.csv")
    (base / log).write_text(_ats("train", str(data), "--out", str(run_dir), "--epochs", str(epochs),
                                 "--overwrite", *given))
    wall = time.time() - t0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "epoch" in r]
    pred = _ats("predict", str(data), "--model", str(run_dir / "best.pt"), "--out", str(base / preds),
                "--overwrite")
    return {"scenario": scenario, "records": records, "wall_s": wall, "predict": pred}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--images", type=int, default=240, help="photos per scenario (train is 60%%: 144)")
    ap.add_argument("--make-only", action="store_true")
    ap.add_argument("--size", type=int, default=0, help="all photos SIZE x SIZE (default: mixed sizes)")
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                    help="an ats train setting, for a comparison with the defaults (repeatable)")
    ap.add_argument("--run", default="run", help="the run's folder name under OUT/SCENARIO (with --set)")
    args = ap.parse_args()
    os.environ.setdefault("ATS_OFFLINE", "1")
    for s in args.scenarios.split(","):
        res = run(s, args.out, args.epochs, args.images, args.seed, args.make_only, args.size, tuple(args.settings),
                  args.run)
        if not res:
            continue
        recs = res["records"]
        split = "val" if "val_acc" in recs[-1] else "test"
        best = max(recs, key=lambda r: (r[f"{split}_acc"], r["epoch"]))  # as ats train chooses best.pt
        first = min(r["epoch"] for r in recs if r[f"{split}_acc"] == best[f"{split}_acc"])
        share = " ".join(f"{r['entropy'] / r['entropy_uniform']:.3f}" for r in recs[:3])
        # train accuracy beside val tells learning from fitting by heart; attention_moved (KL
        # from the attention's start) tells an attention that found something from one that stayed
        print(f"{s} {args.run} {' '.join(args.settings)}: {split} acc per epoch "
              + " ".join(f"{r[f'{split}_acc']:.3f}" for r in recs) + "; train acc per epoch "
              + " ".join(f"{r['train_acc']:.3f}" for r in recs) + "; entropy / uniform per epoch "
              + " ".join(f"{r['entropy'] / r['entropy_uniform']:.3f}" for r in recs) + "; attention moved (nats) "
              + " ".join(f"{r.get('attention_moved') or 0:.2g}" for r in recs), flush=True)
        acc = next((line for line in res["predict"].splitlines() if line.startswith("accuracy")), "?")
        print(f"| {s} | {acc} | {split} {best[f'{split}_acc']:.3f} first at epoch {first} (best.pt: "
              f"{best['epoch']}) | {share} ... {recs[-1]['entropy'] / recs[-1]['entropy_uniform']:.3f} | "
              f"{res['wall_s']:.0f} s, {sum(r['ms_per_sample'] * r['samples'] for r in recs) / 1000 / len(recs):.1f} "
              "s/epoch |", flush=True)

if __name__ == "__main__":
    main()
