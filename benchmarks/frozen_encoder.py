"""A training step with a frozen pretrained encoder against the same step with it trainable;
with ``--store``, epochs of ``ats train`` with the frozen encoder's feature store on and off;
with ``--tile-mil``, ``--method tile-mil`` against ``ats`` on small synthetic slides, one frozen encoder;
with ``--tile-mil-model``, the two at slide scale by a measured cost model.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/frozen_encoder.py [--repeats 2] [--steps 2]
        [--net timm:resnet18] [--device cpu] [--json OUT.json]
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/frozen_encoder.py --store [--epochs 4]
        [--net torchvision:resnet18] [--device cpu] [--json OUT.json]
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/frozen_encoder.py --tile-mil [--epochs 3]
        [--slide-size 1024] [--net torchvision:resnet18] [--device cpu] [--json OUT.json]
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/frozen_encoder.py --store --slides 12288 [--epochs 4]
        [--n-train 4] [--n-test 2] [--net torchvision:resnet18] [--json OUT.json]
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/frozen_encoder.py --tile-mil-model 12288,100000
        [--epochs 2] [--n-test 3] [--sample-tiles 192] [--net torchvision:resnet18] [--json OUT.json]

``--store``: ``ats train`` (the library's ``train``) on a small synthetic set of RGB photos
(24 train and 8 test images of 256x256: tinted noise with one bright square), the encoder
random and frozen (``--feature-weights none``, ``feature_train none``), 16 patches of 32 px
per image from a 16x16 low-res view (256 cells, all of them open to sampling: no brightness support, no
prior), batch 8, no augmentation, ``--workers 0``; the same run
with ``feature_store off`` and ``on``, each in its own run directory. Per epoch: the
training steps' ms per image (``ms_per_sample`` of metrics.jsonl) and the share of the
training steps' patches read back from the store (``feature_hit_rate``); the two runs'
losses are compared too (equal where the encoder's kernels do not depend on the batch).

``--store --slides SIZE``: the same on ``ats make-dataset synthetic-slides --virtual`` slides
of SIZE² (``--n-train`` + ``--n-test``), read as the dataset says (the one-level
synthetic-slides recipe: 12 patches of 64 px from a view at 1/32; ``--recipe
synthetic-slides-12k``: two levels, 4 regions of 768 px, 3 patches of 64 px in each), batch
4; per epoch the wall from the run's start or the previous epoch's line (evaluation
included), the training ms per slide and the share read back.

``--tile-mil-model SIZES``: for each side, ``--n-test`` virtual slides (and 2 training ones).
tile-mil's cost per slide without running it: its tissue tiles counted on each slide (the
Otsu mask of the view at 1/32, 1/64 past 16k², as the method selects them; nothing encoded),
``--sample-tiles`` of them read and encoded by the frozen encoder (chunks of 64, as the
method does) for the time per tile; extraction per slide = tiles x that + the view, its
store = tiles x (4 dim + 20) bytes. Against it ``ats`` measured on the same slides: ``ats
train`` with the size's recipe (synthetic-slides; synthetic-slides-100k past 16k²), the same
frozen encoder, store off, ``--epochs`` epochs, the median training ms per slide; then
``predict`` with its best.pt on each test slide, in process, the view included.

``--tile-mil``: ``ats make-dataset synthetic-slides`` (8 train + 4 test slides of
``--slide-size``², pyramidal TIFFs, its recipe: patches of 64 px, 12 per slide, a view at 1/32),
then ``ats train`` with the same random frozen encoder (``--feature-weights none``,
``feature_train none``), no augmentation, batch 4, ``--workers 0``, three runs in their own
directories: ``--method tile-mil`` (its feature store on, as settled), ``ats`` with the feature
store on, ``ats`` with it off. Per run and epoch: the wall time from the start of the run (epoch
1: settling, the slides' views, and for tile-mil every tissue tile of the train and test
slides encoded) or the previous epoch to the epoch's line, the training steps' ms per slide,
the test accuracy; the feature store's bytes on disk at the end; the run's wall time.

The model is what ``ats train --feature-net timm:resnet18`` builds (randomly initialised:
nothing is downloaded; weights do not change the cost), 16 patches of 64x64 px per image
resized on the device to the encoder's 224 px input, batch 8 of 512x512 RGB images; the
step is ats train's (forward, loss, backward, Adam step), with ``--feature-train none`` or
``all``. Each measurement runs in a fresh process, frozen and trainable alternating
(A B A B...), so that both see the same machine load.

Peak memory: on CPU, tracemalloc sees none of torch's allocations, so it is the growth of
the process's resident set over its size before the first step (``ru_maxrss`` after the
step minus the RSS before it: the gradients, Adam's state and the activations kept for
backward, whatever the allocator returned or not). On CUDA, ``torch.cuda.max_memory_allocated``
over the same step. Time: the median of ``--steps`` steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(mode: str, net: str, steps: int, device_name: str) -> dict:
    import torch

    from ats_cli.core.source import low_res_view
    from ats_cli.models import create_model, model_spec
    from ats_cli.nets.encoders import apply_feature_train
    from ats_cli.recipes import resolve_config
    from ats_cli.train import _optimizer, train_mode

    device = torch.device(device_name)
    torch.manual_seed(0)
    cfg = resolve_config(None, data="-", out="-", feature_net=net, feature_weights="none", feature_train=mode,
                         n_patches=16, patch_size=64, scale=0.125, batch_size=8, entropy=0.01, eval_n_patches=0)
    spec = model_spec(cfg, n_classes=2, channels=3)
    model = create_model(spec).to(device)
    apply_feature_train(model.feature_net, mode)
    opt = _optimizer(cfg, model)
    train_mode(model)
    images = torch.randint(0, 256, (8, 3, 512, 512), dtype=torch.uint8, device=device)
    low = low_res_view(images, cfg.scale)
    labels = torch.tensor([0, 1] * 4, device=device)
    gen = torch.Generator(device=device)

    def step(i: int) -> float:
        gen.manual_seed(i)
        t = time.perf_counter()
        out = model(low, images, generator=gen)
        loss = model.loss(out, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        before = _rss_mb()
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 < before + 64, "building peaked above"
    first = step(0)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024) - before
    times = [step(i) for i in range(1, steps + 1)]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"mode": mode, "peak_mb": peak, "step_s": statistics.median(times), "first_step_s": first,
            "trainable_params": trainable, "optimizer_states": len(opt.state), "threads": torch.get_num_threads()}


def _photos(root) -> str:
    """24 + 8 RGB images of 256x256: noise tinted per image, a bright square whose colour is the class."""
    import numpy as np
    from PIL import Image

    from ats_cli.data.dataset import write_dataset

    rng = np.random.default_rng(0)
    rows = {}
    for split, n in (("train", 24), ("test", 8)):
        os.makedirs(os.path.join(root, split), exist_ok=True)
        rows[split] = []
        for i in range(n):
            label = int(rng.integers(2))
            img = (rng.random((256, 256, 3)) * 80 * rng.random(3)).astype(np.uint8)
            r, c = (int(v) for v in rng.integers(0, 224, 2))
            img[r:r + 32, c:c + 32] = (255, 60, 60) if label else (60, 60, 255)
            Image.fromarray(img).save(os.path.join(root, split, f"{i}.png"))
            rows[split].append({"path": f"{split}/{i}.png", "label": ["blue", "red"][label]})
    write_dataset(root, ["blue", "red"], rows, hints={"channels": 3})
    return root


def store_runs(net: str, epochs: int, device: str, where: str) -> dict:
    """The same ``ats train`` run with the feature store off and on (module docstring)."""
    from ats_cli.recipes import resolve_config
    from ats_cli.train import train

    data = _photos(os.path.join(where, "data"))
    runs = {}
    for mode in ("off", "on"):
        cfg = resolve_config(None, data=data, out=os.path.join(where, mode), feature_net=net, feature_weights="none",
                             feature_train="none", feature_store=mode, n_patches=16, patch_size=32, scale=1 / 16,
                             batch_size=8, epochs=epochs, workers=0, augment="none", device=device, seed=0,
                             min_brightness=0, rarity_prior=0,
                             prepare=False)
        t = time.perf_counter()
        history = train(cfg, log=lambda s: None)
        runs[mode] = {"wall_s": time.perf_counter() - t,
                      "ms_per_sample": [h["ms_per_sample"] for h in history],
                      "hit_rate": [h.get("feature_hit_rate") for h in history],
                      "train_loss": [h["train_loss"] for h in history]}
        print(f"store {mode:3s}: ms/image per epoch " + ", ".join(f"{v:.0f}" for v in runs[mode]["ms_per_sample"])
              + ("; hit rate " + ", ".join(f"{v:.0%}" for v in runs[mode]["hit_rate"]) if mode == "on" else "")
              + f"; {runs[mode]['wall_s']:.0f} s in all", flush=True)
    on = runs["on"]["ms_per_sample"]
    later = statistics.median(on[1:]) if len(on) > 1 else float("nan")
    runs["later_over_first"] = later / on[0]
    runs["same_losses"] = runs["on"]["train_loss"] == runs["off"]["train_loss"]
    print(f"store on: epochs 2+ / epoch 1 = {runs['later_over_first']:.2f}x; losses equal to store off: "
          f"{runs['same_losses']}")
    return runs


def store_slide_runs(net: str, epochs: int, device: str, where: str, size: int, n_train: int, n_test: int,
                     recipe: str | None = None) -> dict:
    """``ats train`` on virtual synthetic slides of ``size``², the feature store off and on,
    with ``recipe`` (None: the one the dataset names) (module docstring)."""
    from ats_cli.recipes import resolve_config

    data = os.path.join(where, "slides")
    subprocess.run([sys.executable, "-m", "ats_cli", "make-dataset", "synthetic-slides", data, "--n-train",
                    str(n_train), "--n-test", str(n_test), "--size", str(size), "--virtual", "--workers", "1"],
                   check=True, capture_output=True)
    runs = {}
    for store in ("off", "on"):
        out = os.path.join(where, f"store-{store}")
        cfg = resolve_config(None, recipe, data=data, out=out, feature_net=net, feature_weights="none",
                             feature_train="none", feature_store=store, batch_size=min(4, n_train), epochs=epochs,
                             workers=0, augment="none", device=device, seed=0)
        runs[store] = _timed_run(cfg, out)
        r = runs[store]
        print(f"store {store:3s}: epoch wall s " + ", ".join(f"{v:.1f}" for v in r["epoch_s"])
              + "; train ms/slide " + ", ".join(f"{v:.0f}" for v in r["ms_per_slide"])
              + ("; read back " + ", ".join(f"{v:.0%}" for v in r["hit_rate"]) if store == "on" else "")
              + f"; store {r['store_bytes'] / 2**20:.2f} MiB; {r['wall_s']:.0f} s in all", flush=True)
    on = runs["on"]["ms_per_slide"]
    runs["later_over_first"] = statistics.median(on[1:]) / on[0] if len(on) > 1 else float("nan")
    runs["same_losses"] = runs["on"]["train_loss"] == runs["off"]["train_loss"]
    print(f"store on: training epochs 2+ / epoch 1 = {runs['later_over_first']:.2f}x; losses equal to store off: "
          f"{runs['same_losses']}")
    return runs


def _tile_cost(net: str, paths: list[str], scale: float, sample: int) -> dict:
    """tile-mil's cost on ``paths`` without running it: each slide's tissue tiles (64 px,
    :func:`~ats_cli.baselines_tilemil.tissue_tiles` on the Otsu mask of its view at ``scale``,
    as the method selects them; nothing encoded), and the time to read and encode ``sample``
    of them, spread over the slides' tissue, in :data:`~ats_cli.baselines_tilemil.TILE_CHUNK`
    chunks with the frozen encoder as :meth:`TileMIL.encode` does without a store."""
    import torch

    from ats_cli.baselines_tilemil import TILE_CHUNK, TileMIL
    from ats_cli.core.model import pixels_to_float
    from ats_cli.core.source import gather_patches
    from ats_cli.data.slides import open_image, tissue_mask
    from ats_cli.models import create_model, model_spec
    from ats_cli.recipes import resolve_config

    torch.manual_seed(0)
    cfg = resolve_config(None, data="-", out="-", feature_net=net, feature_weights="none", feature_train="none",
                         patch_size=64)
    encoder = create_model(model_spec(cfg, n_classes=2, channels=3)).feature_net
    model = TileMIL(encoder, 2, tile_size=64, scale=scale).eval()
    slides, chosen = [], []
    gen = torch.Generator().manual_seed(0)
    for path in paths:
        reader = open_image(path)
        t = time.perf_counter()
        view = reader.low_res_view(scale)
        view_s = time.perf_counter() - t
        offsets, _, grid = model.tiles(tuple(reader.size), tissue_mask(view))
        slides.append({"path": os.path.basename(path), "tiles": len(offsets), "grid": grid, "view_s": view_s,
                       "view": list(view.shape[-2:])})
        pick = torch.randperm(len(offsets), generator=gen)[:max(1, sample // len(paths))]
        chosen.append((reader, offsets[pick]))
    read_s = encode_s = 0.0
    n = 0
    with torch.no_grad():
        for reader, offsets in chosen:
            for start in range(0, len(offsets), TILE_CHUNK):
                chunk = offsets[start:start + TILE_CHUNK][None]
                t = time.perf_counter()
                patches = gather_patches([reader], chunk, (64, 64))[0]
                t2 = time.perf_counter()
                encoder(pixels_to_float(patches))
                read_s, encode_s = read_s + t2 - t, encode_s + time.perf_counter() - t2
                n += chunk.shape[1]
    return {"slides": slides, "sampled": n, "read_s_per_tile": read_s / n, "encode_s_per_tile": encode_s / n,
            "dim": int(encoder.out_features)}


def tile_mil_model(net: str, epochs: int, device: str, where: str, sizes: list[int], n_slides: int,
                   sample: int) -> dict:
    """tile-mil against ``ats`` at slide scale by a measured cost model (module docstring)."""
    from pathlib import Path

    from ats_cli.predict.inputs import InputItem
    from ats_cli.predict.predictor import load_predictor
    from ats_cli.recipes import resolve_config
    from ats_cli.train import train

    out = {}
    for size in sizes:
        data = os.path.join(where, f"v{size}")
        subprocess.run([sys.executable, "-m", "ats_cli", "make-dataset", "synthetic-slides", data, "--n-train",
                        "2", "--n-test", str(n_slides), "--size", str(size), "--virtual", "--workers", "1"],
                       check=True, capture_output=True)
        tests = sorted(str(p) for p in Path(data, "test").glob("*.vslide.json"))
        scale = 1 / 32 if size <= 16384 else 1 / 64  # the one-level recipe's view; 1/64 past it, the 100k recipe's
        cost = _tile_cost(net, tests, scale, sample)
        per_tile = cost["read_s_per_tile"] + cost["encode_s_per_tile"]
        tiles = statistics.mean(s["tiles"] for s in cost["slides"])
        extraction = tiles * per_tile + statistics.mean(s["view_s"] for s in cost["slides"])
        disk = tiles * (4 * cost["dim"] + 20)
        recipe = "synthetic-slides" if size <= 16384 else "synthetic-slides-100k"
        run = os.path.join(where, f"ats{size}")
        cfg = resolve_config(None, recipe, data=data, out=run, feature_net=net, feature_weights="none",
                             feature_train="none", feature_store="off", batch_size=2, epochs=epochs, workers=0,
                             augment="none", device=device, seed=0)
        history = train(cfg, log=lambda s: None)
        step_ms = statistics.median(h["ms_per_sample"] for h in history)
        predictor = load_predictor(os.path.join(run, "best.pt"), device)
        predict_s = []
        for path in tests:
            t = time.perf_counter()
            row = predictor.predict([InputItem(path)], prefetch=False)[0]
            predict_s.append(time.perf_counter() - t)
            assert row.ok, row.error
        r = out[size] = {"tile_cost": cost, "tiles_per_slide": tiles, "extraction_s_per_slide": extraction,
                         "store_bytes_per_slide": disk, "ats_recipe": recipe, "ats_train_ms_per_slide": step_ms,
                         "ats_train_ms_per_epoch": [h["ms_per_sample"] for h in history],
                         "ats_predict_s": predict_s}
        print(f"{size}²: tissue tiles " + ", ".join(str(s["tiles"]) for s in cost["slides"])
              + f"; per tile read {1e3 * cost['read_s_per_tile']:.1f} ms + encode "
              f"{1e3 * cost['encode_s_per_tile']:.1f} ms ({cost['sampled']} sampled); tile-mil extraction "
              f"{extraction:.0f} s and {disk / 2**20:.1f} MiB a slide; ats ({recipe}) training "
              f"{step_ms:.0f} ms a slide an epoch, predict " + ", ".join(f"{v:.1f}" for v in predict_s)
              + " s a slide", flush=True)
        r["epochs_for_10x"] = extraction / (10 * step_ms / 1e3)
        print(f"  ats is >= 10x cheaper than tile-mil's extraction alone for up to {r['epochs_for_10x']:.0f} "
              f"epochs; predict on a new slide {extraction / statistics.median(predict_s):.0f}x", flush=True)
    return out


def _timed_run(cfg, out: str) -> dict:
    """``ats train`` with ``cfg`` in this process, timed per epoch: the wall from the start (or
    the previous epoch's line) to each epoch's line, and per epoch the training ms per slide,
    the share read back from the feature store, the losses and the test accuracy."""
    from ats_cli.train import train

    marks = [time.perf_counter()]

    def log(line: str) -> None:
        if line.startswith("epoch "):
            marks.append(time.perf_counter())

    history = train(cfg, log=log)
    return {"wall_s": marks[-1] - marks[0],
            "epoch_s": [marks[i + 1] - marks[i] for i in range(len(marks) - 1)],
            "ms_per_slide": [h["ms_per_sample"] for h in history],
            "hit_rate": [h.get("feature_hit_rate") for h in history],
            "train_loss": [h["train_loss"] for h in history],
            "test_acc": [h["test_acc"] for h in history],
            "store_bytes": _store_bytes(out)}


def _store_bytes(run: str) -> int:
    """Bytes of the feature segments under ``run``'s store (0 without one)."""
    from pathlib import Path

    return sum(p.stat().st_size for p in Path(run, "cache", "features").glob("*/*.seg"))


def tile_mil_runs(net: str, epochs: int, device: str, where: str, size: int) -> dict:
    """``--method tile-mil`` against ``ats`` (store on, off) on the same slides (module docstring)."""
    from ats_cli.recipes import resolve_config

    data = os.path.join(where, "slides")
    subprocess.run([sys.executable, "-m", "ats_cli", "make-dataset", "synthetic-slides", data, "--n-train", "8",
                    "--n-test", "4", "--size", str(size), "--workers", "1"], check=True, capture_output=True)
    runs = {}
    for name, method, store in (("tile-mil", "tile-mil", "auto"), ("ats, store on", "ats", "on"),
                                ("ats, store off", "ats", "off")):
        out = os.path.join(where, name.replace(", ", "-").replace(" ", "-"))
        cfg = resolve_config(None, data=data, out=out, method=method, feature_net=net, feature_weights="none",
                             feature_train="none", feature_store=store, batch_size=4, epochs=epochs, workers=0,
                             augment="none", device=device, seed=0)
        runs[name] = _timed_run(cfg, out)
        r = runs[name]
        print(f"{name:15s}: epoch wall s " + ", ".join(f"{v:.1f}" for v in r["epoch_s"])
              + "; train ms/slide " + ", ".join(f"{v:.0f}" for v in r["ms_per_slide"])
              + "; test acc " + ", ".join(f"{v:.2f}" for v in r["test_acc"])
              + f"; store {r['store_bytes'] / 2**20:.2f} MiB; {r['wall_s']:.0f} s in all", flush=True)
    tile = runs["tile-mil"]["epoch_s"]
    runs["tile_mil_later_over_first"] = statistics.median(tile[1:]) / tile[0] if len(tile) > 1 else float("nan")
    print(f"tile-mil: epochs 2+ / epoch 1 = {runs['tile_mil_later_over_first']:.3f}x; store "
          f"{runs['tile-mil']['store_bytes'] / max(runs['ats, store on']['store_bytes'], 1):.1f}x ats's")
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--net", default="timm:resnet18")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", action="store_true", help="epochs with the feature store on and off")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--tile-mil", action="store_true", help="--method tile-mil against ats on synthetic slides")
    p.add_argument("--slide-size", type=int, default=1024)
    p.add_argument("--recipe", default=None, help="with --store --slides: train with this recipe (default: the "
                   "dataset's, the one-level synthetic-slides; synthetic-slides-12k: two levels)")
    p.add_argument("--slides", type=int, default=0, metavar="SIZE",
                   help="with --store: virtual synthetic slides of SIZE² instead of the photos")
    p.add_argument("--tile-mil-model", default=None, metavar="SIZES",
                   help="tile-mil's cost at these slide sides (comma-separated) by a measured cost model")
    p.add_argument("--sample-tiles", type=int, default=192)
    p.add_argument("--n-train", type=int, default=4)
    p.add_argument("--n-test", type=int, default=2)
    a = p.parse_args()
    if a.tile_mil_model:
        import tempfile

        with tempfile.TemporaryDirectory() as where:
            model = tile_mil_model(a.net, a.epochs, a.device, where, [int(v) for v in a.tile_mil_model.split(",")],
                                   a.n_test, a.sample_tiles)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"net": a.net, "device": a.device, "sizes": model}, f, indent=1)
        return
    if a.tile_mil:
        import tempfile

        with tempfile.TemporaryDirectory() as where:
            runs = tile_mil_runs(a.net, a.epochs, a.device, where, a.slide_size)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"net": a.net, "device": a.device, "slide_size": a.slide_size, **runs}, f, indent=1)
        return
    if a.store:
        import tempfile

        with tempfile.TemporaryDirectory() as where:
            runs = (store_slide_runs(a.net, a.epochs, a.device, where, a.slides, a.n_train, a.n_test, a.recipe)
                    if a.slides
                    else store_runs(a.net, a.epochs, a.device, where))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"net": a.net, "device": a.device, **runs}, f, indent=1)
        return
    if a.child:
        print(json.dumps(child(a.child, a.net, a.steps, a.device)))
        return
    rows = []
    for r in range(a.repeats):
        for mode in ("none", "all"):  # A B A B: the same load for both
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--net", a.net, "--steps", str(a.steps),
                                  "--device", a.device], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"repeat {r + 1} {mode:4s}: peak +{row['peak_mb']:.0f} MB, step {row['step_s']:.2f} s "
                  f"(first {row['first_step_s']:.2f} s), {row['trainable_params']:,} trainable parameters, "
                  f"{row['optimizer_states']} optimizer states", flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    mem, time_ = med("none", "peak_mb") / med("all", "peak_mb"), med("none", "step_s") / med("all", "step_s")
    print(f"frozen / trainable: peak memory {mem:.2f}x, step time {time_:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"net": a.net, "device": a.device, "rows": rows, "memory_ratio": mem, "time_ratio": time_}, f,
                      indent=1)


if __name__ == "__main__":
    main()
