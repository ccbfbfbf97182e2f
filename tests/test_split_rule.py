"""The held-out split of a store that grows: which rows a generic opening covers is decided by the
group's own size (identity version 7), so appending rows never moves a row of another group; a store
made before keeps the share-of-store rule it was trained with, and starting from a drafter trained on
one store with the same split on a store keyed otherwise is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from shared.reader import content_keys
from stage2_train.data.split import heldout_mask

GROUP = "a" * 16  # the opening 20 rows share


def records(num_rows: int, *, group: int = 20) -> list[dict]:
    """One shard record of `num_rows` rows: the first `group` share an opening, the others open alike
    with no other row, every row has its own tokens."""
    openings = [GROUP] * group + [f"{i:015x}0" for i in range(1000, 1000 + num_rows - group)]
    contents = [f"{i:015x}0" for i in range(5000, 5000 + num_rows)]
    return [{
        "index": 0, "name": "shard-000000", "num_samples": num_rows, "num_tokens": 4 * num_rows, "bytes": 1,
        "checksum": f"c{num_rows}", "sample_ids": list(range(num_rows)), "lengths": [4] * num_rows, "rows_sha256": "r",
        "opening_hashes": openings, "content_hashes": contents,
    }]


def heldout_of_first(num_rows: int, version: int, first: int = 300, seed: int = 0) -> np.ndarray:
    keys = content_keys(records(num_rows), np.arange(num_rows), version)
    return heldout_mask(keys, 0.25, seed)[:first]


def test_appending_rows_never_moves_a_row_of_a_store_made_at_version_7():
    """20 rows sharing one opening among 300, then 500: the share rule (generic past 5% of the store)
    kept them apart at 300 rows and together at 500, moving rows between train and held-out under a
    drafter trained before (init_from on the grown store, eval with allow_other_store, a resume after
    reprocess). At version 7 the group's own 20 rows decide: every row stays where it was."""
    for seed in range(20):
        assert (heldout_of_first(300, 7, seed=seed) == heldout_of_first(500, 7, seed=seed)).all()
        assert (heldout_of_first(300, 7, seed=seed) == heldout_of_first(2000, 7, seed=seed)).all()


def test_a_store_made_before_version_7_keeps_the_split_it_was_trained_with():
    """Its runs resume, and their checkpoints are evaluated, on the split they were cut with: the
    share rule, which at 500 rows keeps the 20 rows together."""
    keys = content_keys(records(500), np.arange(500), 6)
    assert len(set(keys[:20].tolist())) == 1
    assert len(set(content_keys(records(300), np.arange(300), 6)[:20].tolist())) == 20
    assert len(set(content_keys(records(500), np.arange(500), 7)[:20].tolist())) == 20
    moved = sum(int((heldout_of_first(300, 6, seed=s) != heldout_of_first(500, 6, seed=s)).sum()) for s in range(20))
    assert moved > 0  # what version 7 removes


def write_store(folder: Path, num_rows: int, version: int) -> dict:
    manifest = {"schema_version": 1, "storage": {}, "layer_ids": [1], "target": {}, "identity_version": version,
                "shards": records(num_rows)}
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def test_init_from_with_the_same_split_on_a_store_keyed_otherwise_is_refused_naming_the_rows(tmp_path):
    """A drafter trained on a version-6 store of 300 rows, started from on the same rows grown to 500:
    the same eval.holdout_fraction and eval.split_seed cut another split there (the 20 rows now share one
    key), so rows it trained on were held out and every held-out figure of the new run counted them,
    with nothing said (the check compared only the split settings). Now the rows are compared."""
    from stage2_train.serve.trained_on import TrainedOn, init_split_problem
    from stage2_train.train.state import store_digest

    seed = next(s for s in range(100) if heldout_mask(np.asarray([int(GROUP[:15], 16)]), 0.25, s)[0])
    old = write_store(tmp_path / "old", 300, 6)
    record = TrainedOn("step_000100", 0.25, seed, store_digest(old), store=str(tmp_path / "old"))
    cfg = SimpleNamespace(eval=SimpleNamespace(holdout_fraction=0.25, split_seed=seed))
    trained_then = int((~heldout_of_first(300, 6, first=20, seed=seed)).sum())
    assert trained_then > 0
    problem = init_split_problem(cfg, record, write_store(tmp_path / "grown", 500, 6))
    assert problem.startswith(f"model.init_from: that drafter was trained on {tmp_path / 'old'} with the same split "
                              f"(holdout_fraction=0.25, split_seed={seed}, recorded in step_000100), yet {trained_then} sample(s) ")
    assert problem.endswith(f"Train without model.init_from, or on the store it was trained on ({tmp_path / 'old'})")
    # keyed alike (version 7 on both), the grown store holds out none of its training rows
    record7 = TrainedOn("step_000100", 0.25, seed, store_digest(write_store(tmp_path / "old7", 300, 7)), store=str(tmp_path / "old7"))
    assert init_split_problem(cfg, record7, write_store(tmp_path / "grown7", 500, 7)) is None


def test_extracting_into_a_version_6_store_whose_openings_could_move_says_so(caplog):
    """A store made at version 6 keeps the share rule, so rows extracted into it can move a shared
    opening's rows: the log says so, and how to get the fixed count; a store with no opening past
    GENERIC_OPENING_MIN rows (where the rules agree) says nothing."""
    from stage1_extract.prepare import split_keys

    def rows(shared: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(opening_hash="a" if i < shared else f"o{i}", prompt_hash="") for i in range(40)]

    for version, shared, warned in ((6, 17, True), (6, 16, False), (7, 17, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="stage1_extract.prepare"):
            split_keys(rows(shared), {"identity_version": version}, Path("chat.jsonl"), False, "run/store")
        assert ("run/store was made at identity version 6: an opening shared by more than 16 rows counts as generic" in caplog.text) is warned
        assert ("Extract into a new store (store.path) for a fixed count" in caplog.text) is warned
