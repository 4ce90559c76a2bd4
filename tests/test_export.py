"""ats export: a checkpoint made a model to predict with -- read with another pooling or
without its none logit, its none logit moved to another prior by Bayes' rule -- each
refusal one line naming the file, nothing written; the CLI says what it did."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from ats_cli.checkpoint import load_checkpoint, load_model, save_checkpoint
from ats_cli.cli import app
from ats_cli.config import TrainConfig
from ats_cli.export import ExportError, export_checkpoint, none_shift, parse_share
from ats_cli.models import create_model, model_spec
from ats_cli.pretrain.internals import none_head

runner = CliRunner()


def _spec(**kw):
    return model_spec(TrainConfig(patch_size=16, scale=0.25, n_patches=4, feature_width=8, min_brightness=0.0,
                                  rarity_prior=0.0, **kw), n_classes=3, channels=1)


def test_export_reads_one_checkpoint_with_another_pooling_and_without_its_none_logit(tmp_path):
    """--pooling / --none-class off: the same weights, pooled as asked; dropping the none
    logit leaves every other tensor as it was."""
    src = tmp_path / "stage1.pt"
    m = create_model(_spec(pooling="votes", none_class="on"))
    save_checkpoint(src, spec=_spec(pooling="votes", none_class="on"), classes=["a", "b", "c"], model=m)
    export_checkpoint(src, tmp_path / "counts.pt", pooling="counts")
    export_checkpoint(src, tmp_path / "plain.pt", none_class="off")
    counts, ckpt_counts = load_model(tmp_path / "counts.pt")
    plain, ckpt = load_model(tmp_path / "plain.pt")
    assert ckpt_counts["spec"]["pooling"]["name"] == "counts" and none_head(counts) is not None
    assert ckpt["spec"]["pooling"] == {"name": "votes", "none_class": False} and none_head(plain) is None
    assert type(counts.pooling).__name__ == "CountPooling" and type(plain.pooling).__name__ == "VotePooling"
    assert ckpt_counts["export"]["pooling"]["name"] == "counts"  # recorded
    assert ckpt["export"]["pooling"]["none_class"] is False
    kept = m.state_dict()
    assert all(torch.equal(v, kept[k]) for k, v in plain.state_dict().items())
    assert set(kept) - set(plain.state_dict()) == {"pooling.none.weight", "pooling.none.bias"}
    # features cannot read a none logit: one line naming the file, nothing written
    with pytest.raises(ExportError, match="stage1.pt: cannot be exported so .*none_class on needs pooling votes"):
        export_checkpoint(src, tmp_path / "features.pt", pooling="features")
    assert not (tmp_path / "features.pt").exists()


def test_export_none_prior_gives_the_posterior_under_the_new_prior(tmp_path):
    """--none-prior P: each patch's softmax over the classes and none becomes the trained
    one reweighted by pi_test / pi_train (Bayes' rule: "none" from Q to P, each class from
    (1-Q)/k to (1-P)/k) and renormalised; only the none bias moves; the values are recorded;
    a checkpoint without the trained share or without a none logit is refused in one line,
    and so is a second shift."""
    src = tmp_path / "stage1.pt"
    m = create_model(_spec(pooling="counts", none_class="on"))
    save_checkpoint(src, spec=_spec(pooling="counts", none_class="on"), classes=["a", "b", "c"], model=m,
                    pretrain={"none_share": 0.6})
    export_checkpoint(src, tmp_path / "shifted.pt", none_prior=0.9)
    shifted, ckpt = load_model(tmp_path / "shifted.pt")
    assert ckpt["release"]["none_prior"] == 0.9 and ckpt["release"]["trained_none_share"] == 0.6
    assert ckpt["release"]["none_shift"] == pytest.approx(none_shift(0.9, 0.6))
    assert ckpt["pretrain"]["none_share"] == 0.6  # what it was trained on stays readable
    feats = torch.randn(64, m.classifier.in_features)

    def with_none(model):
        return torch.cat([model.classifier(feats), none_head(model)(feats)], -1).softmax(-1)

    with torch.no_grad():
        before, after = with_none(m), with_none(shifted)
    k = m.classifier.out_features
    ratio = torch.tensor([(1 - 0.9) / (1 - 0.6)] * k + [0.9 / 0.6])  # pi_test / pi_train, per class
    bayes = before * ratio
    torch.testing.assert_close(after, bayes / bayes.sum(-1, keepdim=True))
    assert (after[:, -1] > before[:, -1]).all()  # more noise expected: every patch leans more to none
    kept, new = m.state_dict(), shifted.state_dict()
    assert [n for n in kept if not torch.equal(kept[n], new[n])] == ["pooling.none.bias"]
    # the trained share is needed: recorded, or given
    bare = tmp_path / "bare.pt"
    save_checkpoint(bare, spec=_spec(pooling="counts", none_class="on"), classes=["a", "b", "c"], model=m)
    with pytest.raises(ExportError, match="bare.pt: does not record the share .* --trained-none-share"):
        export_checkpoint(bare, tmp_path / "x.pt", none_prior=0.9)
    export_checkpoint(bare, tmp_path / "given.pt", none_prior=0.9, trained_none_share=0.6)
    assert torch.equal(load_checkpoint(tmp_path / "given.pt")["model"]["pooling.none.bias"], new["pooling.none.bias"])
    with pytest.raises(ExportError, match="needs the checkpoint's none logit"):
        export_checkpoint(src, tmp_path / "y.pt", none_prior=0.9, none_class="off")
    with pytest.raises(ExportError, match="shifted.pt: its none logit is already read at prior 0.9"):
        export_checkpoint(tmp_path / "shifted.pt", tmp_path / "z.pt", none_prior=0.9)
    assert not any((tmp_path / n).exists() for n in ("x.pt", "y.pt", "z.pt"))


def test_export_command_sets_the_reading_and_refuses_in_one_line(tmp_path):
    """The command a release is made with: 50/55 read as a share, the options recorded and
    printed; a second shift, a share that is not one, a missing file: one line, exit != 0."""
    src = tmp_path / "stage1.pt"
    m = create_model(_spec(pooling="counts", none_class="on"))
    save_checkpoint(src, spec=_spec(pooling="counts", none_class="on"), classes=["a", "b", "c"], model=m,
                    pretrain={"none_share": 0.6}, optimizer={"state": {}})
    out = tmp_path / "model.pt"
    result = runner.invoke(app, ["export", str(src), str(out), "--eval-n-patches", "80", "--pooling", "counts",
                                 "--count-floor", "0.02", "--none-prior", "50/55"])
    assert result.exit_code == 0, result.output
    assert "model.pt" in result.output and "eval_n_patches 80" in result.output
    ckpt = load_checkpoint(out)
    assert ckpt["spec"]["eval_n_patches"] == 80 and ckpt["spec"]["pooling"]["floor"] == 0.02
    assert ckpt["release"]["none_prior"] == pytest.approx(50 / 55) and "optimizer" not in ckpt
    assert ckpt["export"]["source"] == "stage1.pt"
    for args, says in (([str(out), str(tmp_path / "again.pt"), "--none-prior", "0.5"], "already read at prior"),
                       ([str(src), str(tmp_path / "bad.pt"), "--none-prior", "half"], "share like 0.9 or 50/55"),
                       ([str(tmp_path / "nowhere.pt"), str(tmp_path / "n.pt")], "nowhere.pt: model file not found"),
                       ([str(src), str(tmp_path / "f.pt"), "--count-floor", "2"], "count-floor")):
        result = runner.invoke(app, ["export", *args])
        assert result.exit_code != 0 and says in " ".join(result.output.split()), (args, result.output)
        assert "Traceback" not in result.output
    assert not any((tmp_path / n).exists() for n in ("again.pt", "bad.pt", "n.pt", "f.pt"))
    # a reading floor of its own (eval_floor) gives way to the one --count-floor gives: one floor
    top, read = tmp_path / "top.pt", tmp_path / "read.pt"
    spec = _spec(pooling="topmost-counts", none_class="on", count_floor=0.15, eval_count_floor=0.07)
    assert spec["pooling"]["eval_floor"] == 0.07
    save_checkpoint(top, spec=spec, classes=["a", "b", "c"], model=create_model(spec), optimizer={"state": {}})
    assert runner.invoke(app, ["export", str(top), str(read), "--count-floor", "0.05"]).exit_code == 0
    assert load_checkpoint(read)["spec"]["pooling"] == {"name": "topmost-counts", "none_class": True, "floor": 0.05}


def test_parse_share():
    assert parse_share("50/55") == pytest.approx(50 / 55) and parse_share("0.9") == 0.9
    with pytest.raises(ValueError, match="50/55"):
        parse_share("1/0")
