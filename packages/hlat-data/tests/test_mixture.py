"""Weighted mixtures: the blend follows the weights row by row, each row is its source's own,
caps end sources, and resume is exact (also across a dp_size change and, when asked, a
changed mixture)."""

from __future__ import annotations

import copy
import itertools
import re

import numpy as np
import pytest

from hlat_data import ArrowSource, DataError, MixedLoader, MixtureSource, PackedLoader, merge_states
from hlat_data.mixture import source_seed

SEQ = 32


@pytest.fixture(scope="module")
def parts(tmp_path_factory, documents, arrow_writer):
    """Three Arrow sources cut from the corpus: 20, 12 and 16 documents."""
    root = tmp_path_factory.mktemp("mixture")
    cuts = {"web": documents[:20], "code": documents[20:32], "books": documents[32:48]}
    return {name: str(arrow_writer(root / f"{name}.arrow", texts)) for name, texts in cuts.items()}


def mixture(parts, weights, **caps):
    return [
        MixtureSource(name, ArrowSource(parts[name]), weight, **caps.get(name, {}))
        for name, weight in weights.items()
    ]


def make(parts, tokenizer, weights, *, mbs=2, dp_rank=0, dp_size=1, caps=None, seq=SEQ, **kw):
    return MixedLoader(
        mixture(parts, weights, **(caps or {})),
        tokenizer,
        seq,
        mbs,
        dp_rank,
        dp_size,
        seed=7,
        block_size=2,
        **kw,
    )


def own_rows(parts, tokenizer, name, count, dp_rank=0, dp_size=1):
    """The first ``count`` rows of one source packed alone, as the mixture packs it."""
    loader = PackedLoader(
        ArrowSource(parts[name]), tokenizer, SEQ, 1, dp_rank, dp_size,
        seed=source_seed(7, name), block_size=2,
    )  # fmt: skip
    return [b.input_ids[0] for b in itertools.islice(loader, count)]


def rows_of(batches):
    return [row for b in batches for row in b.input_ids]


def rows_by_source(loader, count=None, until=None):
    """The rows of a mixture of one-row batches, by the source each came from: of ``count``
    batches, or until source ``until`` has ended."""
    out = {s.name: [] for s in loader.sources}
    tokens = {name: c["tokens"] for name, c in loader.composition().items()}
    for batch in itertools.islice(loader, count):
        composition = loader.composition()
        (name,) = [n for n, c in composition.items() if c["tokens"] != tokens[n]]
        tokens[name] = composition[name]["tokens"]
        out[name].append(batch.input_ids[0])
        if until is not None and composition[until]["ended"]:
            break
    return out


def test_rows_follow_the_weights_and_each_is_its_sources_own(parts, tokenizer):
    weights = {"web": 0.5, "code": 0.3, "books": 0.2}
    loader = make(parts, tokenizer, weights)
    rows = rows_of(itertools.islice(loader, 30))
    heads = {name: own_rows(parts, tokenizer, name, 60) for name in weights}
    taken = dict.fromkeys(weights, 0)
    for n, row in enumerate(rows):
        # the schedule's pick is the source furthest behind its share
        deficits = {d: weights[d] * (n + 1) - taken[d] for d in weights}
        pick = max(weights, key=lambda d: (deficits[d], -list(weights).index(d)))
        np.testing.assert_array_equal(row, heads[pick][taken[pick]])
        taken[pick] += 1
        for d in weights:  # token shares within one row of the weights at every prefix
            assert abs(taken[d] - weights[d] * (n + 1)) <= 1
    composition = loader.composition()
    assert {d: c["tokens"] for d, c in composition.items()} == {d: taken[d] * SEQ for d in weights}
    assert composition["web"]["share"] == pytest.approx(0.5, abs=1 / 60)
    assert all(c["epoch"] >= 0 and not c["ended"] for c in composition.values())


def test_resume_is_exact(parts, tokenizer):
    weights = {"web": 2, "code": 1, "books": 1}
    whole = rows_of(itertools.islice(make(parts, tokenizer, weights), 25))
    first = make(parts, tokenizer, weights)
    head = rows_of(itertools.islice(first, 11))
    resumed = make(parts, tokenizer, weights)
    resumed.load_state_dict(first.state_dict())
    tail = rows_of(itertools.islice(resumed, 14))
    np.testing.assert_array_equal(np.stack(head + tail), np.stack(whole))
    assert resumed.state_dict()["batches"] == 25


def test_caps_end_a_source_and_the_rest_are_renormalised(parts, tokenizer):
    weights = {"web": 4, "code": 1, "books": 1}
    caps = {"code": {"max_tokens": 5 * SEQ}, "web": {"epochs": 1}}
    loader = make(parts, tokenizer, weights, caps=caps, mbs=1)
    rows = rows_of(itertools.islice(loader, 800))
    composition = loader.composition()
    assert composition["code"]["tokens"] == 5 * SEQ and composition["code"]["ended"]
    web = PackedLoader(
        ArrowSource(parts["web"]), tokenizer, SEQ, 1, seed=source_seed(7, "web"),
        block_size=2, num_epochs=1,
    )  # fmt: skip
    assert composition["web"]["tokens"] == sum(1 for _ in web) * SEQ
    assert composition["web"]["ended"] and not composition["books"]["ended"]
    assert len(rows) == 800  # books repeats, so the mixture goes on


def test_every_source_ended_ends_the_loader(parts, tokenizer):
    loader = make(
        parts,
        tokenizer,
        {"web": 1, "code": 1},
        caps={"web": {"epochs": 1}, "code": {"epochs": 2}},
        mbs=1,
    )
    rows = rows_of(loader)
    composition = loader.composition()
    assert all(c["ended"] for c in composition.values())
    assert len(rows) * SEQ == sum(c["tokens"] for c in composition.values())


def test_a_changed_mixture_is_refused_unless_asked_for(parts, tokenizer):
    first = make(parts, tokenizer, {"web": 1, "code": 1})
    rows_of(itertools.islice(first, 6))
    state = first.state_dict()
    changed = make(parts, tokenizer, {"web": 1, "code": 3, "books": 1})
    before = changed.state_dict()
    with pytest.raises(DataError, match=r"'books' added.*'code' weight: state has 1.0.*continue"):
        changed.load_state_dict(state)
    assert changed.state_dict() == before  # a refusal changes nothing
    taken_web = first.composition()["web"]["tokens"] // SEQ
    cont = make(parts, tokenizer, {"web": 1, "code": 3, "books": 1}, on_change="continue")
    cont.load_state_dict(state)
    rows = rows_of(itertools.islice(cont, 20))
    # the kept source goes on from where it stood, the new one from its beginning
    web = own_rows(parts, tokenizer, "web", taken_web + 40)[taken_web:]
    books = own_rows(parts, tokenizer, "books", 40)
    seen_web = [r for r in rows if any(np.array_equal(r, w) for w in web[:8])]
    assert seen_web and np.array_equal(seen_web[0], web[0])
    assert any(np.array_equal(rows[i], books[0]) for i in range(len(rows)))
    shares = cont.composition()
    assert shares["code"]["tokens"] > shares["web"]["tokens"] - taken_web * SEQ


def test_a_kept_source_with_other_files_is_refused(parts, tokenizer):
    first = make(parts, tokenizer, {"web": 1, "code": 1})
    rows_of(itertools.islice(first, 3))
    state = first.state_dict()
    swapped = MixedLoader(
        [
            MixtureSource("web", ArrowSource(parts["books"]), 1),
            MixtureSource("code", ArrowSource(parts["code"]), 1),
        ],
        tokenizer, SEQ, 2, seed=7, block_size=2,
    )  # fmt: skip
    with pytest.raises(DataError, match=r"mixture source .web.*source changed"):
        swapped.load_state_dict(state)


def test_merged_states_resume_at_the_same_and_at_another_dp_size(parts, tokenizer):
    weights = {"web": 1, "code": 1, "books": 1}
    ranks = [make(parts, tokenizer, weights, dp_rank=r, dp_size=2, mbs=1) for r in range(2)]
    for loader in ranks:
        rows_of(itertools.islice(loader, 7))
    merged = merge_states([loader.state_dict() for loader in ranks])
    assert merged["dp_size"] == 2 and set(merged["sources"]) == set(weights)
    drawn = sum(loader.composition()["web"]["tokens"] for loader in ranks)
    # same dp: each rank continues exactly
    for r, loader in enumerate(ranks):
        again = make(parts, tokenizer, weights, dp_rank=r, dp_size=2, mbs=1)
        again.load_state_dict(merged)
        np.testing.assert_array_equal(
            np.stack(rows_of(itertools.islice(again, 5))),
            np.stack(rows_of(itertools.islice(loader, 5))),
        )
    # one process: reads on, holding the rows both ranks drew
    single = make(parts, tokenizer, weights, mbs=1)
    single.load_state_dict(merged)
    assert single.composition()["web"]["tokens"] == drawn
    assert len(rows_of(itertools.islice(single, 9))) == 9
    with pytest.raises(DataError, match="rank 0 of 2"):
        make(parts, tokenizer, weights, mbs=1).load_state_dict(ranks[0].state_dict())


@pytest.mark.parametrize(("old", "new", "steps"), [(4, 1, 18), (1, 4, 30)])
def test_a_token_cap_holds_over_all_ranks_across_a_dp_size_change(
    parts, tokenizer, old, new, steps
):
    weights = {"web": 1, "code": 1, "books": 1}
    caps = {"code": {"max_tokens": 40 * SEQ}}
    before = [
        make(parts, tokenizer, weights, dp_rank=r, dp_size=old, mbs=1, caps=caps)
        for r in range(old)
    ]
    drawn = sum(len(rows_by_source(loader, steps)["code"]) for loader in before)
    assert 0 < drawn < 40
    merged = merge_states([loader.state_dict() for loader in before])
    after = [
        make(parts, tokenizer, weights, dp_rank=r, dp_size=new, mbs=1, caps=caps)
        for r in range(new)
    ]
    for loader in after:
        loader.load_state_dict(merged)
    # the rows drawn are shared out among the new ranks, none counted twice or dropped
    assert sum(loader.composition()["code"]["tokens"] for loader in after) == drawn * SEQ
    more = [rows_by_source(loader, 400, until="code")["code"] for loader in after]
    assert all(loader.composition()["code"]["ended"] for loader in after)
    assert drawn + sum(map(len, more)) == 40


@pytest.mark.parametrize("dp_size", [1, 2])
def test_a_token_cap_holds_across_a_seq_len_change(parts, tokenizer, dp_size):
    weights = {"web": 1, "code": 1, "books": 1}
    caps = {"code": {"max_tokens": 40 * SEQ}}
    before = [
        make(parts, tokenizer, weights, dp_rank=r, dp_size=dp_size, mbs=1, caps=caps)
        for r in range(dp_size)
    ]
    drawn = [len(rows_by_source(loader, 18 // dp_size)["code"]) for loader in before]
    assert 0 < sum(drawn) < 40
    states = [loader.state_dict() for loader in before]
    state = merge_states(states) if dp_size > 1 else states[0]
    after = [
        make(parts, tokenizer, weights, dp_rank=r, dp_size=dp_size, mbs=1, caps=caps, seq=2 * SEQ)
        for r in range(dp_size)
    ]
    for rank, loader in enumerate(after):
        loader.load_state_dict(state)
        assert loader.composition()["code"]["tokens"] == drawn[rank] * SEQ
    more = [rows_by_source(loader, 400, until="code")["code"] for loader in after]
    assert all(len(row) == 2 * SEQ for rows in more for row in rows)
    for rank, loader in enumerate(after):
        # rows of 2 * SEQ up to this rank's half of the cap, in tokens
        share = 40 * SEQ // dp_size
        wanted = -(-(share - drawn[rank] * SEQ) // (2 * SEQ))
        assert len(more[rank]) == wanted
        assert loader.composition()["code"]["tokens"] == drawn[rank] * SEQ + wanted * 2 * SEQ


def test_a_mixture_state_of_rows_loads_with_the_seq_len_it_was_saved_with(parts, tokenizer):
    weights = {"web": 1, "code": 1}
    first = make(parts, tokenizer, weights, mbs=1)
    rows_of(itertools.islice(first, 9))
    state = first.state_dict()
    # as hlat-data before 0.7 saved it: rows drawn from each source, no seq_len
    state["rows"] = [t // SEQ for t in state.pop("tokens")]
    del state["seq_len"]
    same = make(parts, tokenizer, weights, mbs=1)
    with pytest.warns(UserWarning, match=r'counts the rows .* seq_len 32. .*state\["seq_len"\]'):
        same.load_state_dict(copy.deepcopy(state))
    assert {n: c["tokens"] for n, c in same.composition().items()} == {
        n: c["tokens"] for n, c in first.composition().items()
    }
    resumed = make(parts, tokenizer, weights, mbs=1, seq=2 * SEQ)
    state["seq_len"] = SEQ
    resumed.load_state_dict(state)
    assert {n: c["tokens"] for n, c in resumed.composition().items()} == {
        n: c["tokens"] for n, c in first.composition().items()
    }


@pytest.mark.parametrize("new", [1, 3])
def test_a_source_one_old_rank_finished_is_read_to_its_end_by_the_new_ranks(
    tmp_path, documents, tokenizer, arrow_writer, parts, new
):
    # blocks of two documents in corpus order: rank 0 of 4 reads blocks 0, 4 and 8, whose
    # documents are short, so it finishes its share of the one epoch long before the others
    texts = [d for d in documents if len(d) >= 600][:24]
    texts = [t[:80] if i // 2 % 4 == 0 else t[:600] for i, t in enumerate(texts)]
    capped = {"web": str(arrow_writer(tmp_path / "capped.arrow", texts)), "books": parts["books"]}
    weights, caps = {"web": 1, "books": 1}, {"web": {"epochs": 1}}

    def loader(rank, size):
        return make(capped, tokenizer, weights, dp_rank=rank, dp_size=size, mbs=1, caps=caps,
                    shuffle=False)  # fmt: skip

    before = [loader(r, 4) for r in range(4)]
    for old in before:
        rows_by_source(old, 24)
    assert [old.composition()["web"]["ended"] for old in before] == [True, False, False, False]
    merged = merge_states([old.state_dict() for old in before])
    for rank in range(new):
        resumed = loader(rank, new)
        resumed.load_state_dict(merged)
        assert not resumed.composition()["web"]["ended"]
        got = rows_by_source(resumed, 2000, until="web")["web"]
        # every row the source has left for this rank, as the source alone gives them
        alone = PackedLoader(
            ArrowSource(capped["web"]), tokenizer, SEQ, 1, rank, new,
            seed=source_seed(7, "web"), block_size=2, shuffle=False, num_epochs=1,
        )  # fmt: skip
        alone.load_state_dict(merged["sources"]["web"])
        expected = [b.input_ids[0] for b in alone]
        assert len(expected) > 10
        np.testing.assert_array_equal(np.stack(got), np.stack(expected))


def test_workers_give_the_same_batches(parts, tokenizer):
    weights = {"web": 1, "code": 1}
    serial = rows_of(itertools.islice(make(parts, tokenizer, weights), 8))
    with_workers = rows_of(itertools.islice(make(parts, tokenizer, weights, num_workers=2), 8))
    np.testing.assert_array_equal(np.stack(serial), np.stack(with_workers))


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ([], "at least one source"),
        ([("a", 1), ("a", 2)], "used twice"),
        ([("a", 0)], "weight must be a positive number"),
        ([("a", float("nan"))], "weight must be a positive number"),
        ([("", 1)], "needs a name"),
    ],
)
def test_bad_specs_are_named(parts, tokenizer, sources, message):
    spec = [MixtureSource(name, ArrowSource(parts["web"]), w) for name, w in sources]
    with pytest.raises(DataError, match=message):
        MixedLoader(spec, tokenizer, SEQ, 1)


@pytest.mark.parametrize(
    ("field", "value"),
    [("epochs", 1.5), ("epochs", True), ("epochs", 0), ("max_tokens", "5M"), ("max_tokens", 1e6)],
)
def test_caps_must_be_integers(parts, tokenizer, field, value):
    spec = [MixtureSource("web", ArrowSource(parts["web"]), 1, **{field: value})]
    message = rf"source 0 \('web'\): {field} must be an integer of at least 1 or None, got "
    with pytest.raises(DataError, match=message + re.escape(repr(value))):
        MixedLoader(spec, tokenizer, SEQ, 1)


def test_a_cap_that_is_not_an_integer_in_a_mixture_file_is_one_line_with_status_2(
    parts, tokenizer_path, tmp_path, capsys
):
    from hlat_data.cli import main

    toml = tmp_path / "mixture.toml"
    web, code = parts["web"], parts["code"]
    toml.write_text(
        f'[[sources]]\nname = "web"\npaths = ["{web}"]\nweight = 0.7\nmax_tokens = "5M"\n\n'
        f'[[sources]]\nname = "code"\npaths = ["{code}"]\nweight = 0.3\n'
    )
    assert main(["stats", "--mixture", str(toml), "--tokenizer", tokenizer_path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "hlat-data stats: mixture source 0 ('web'): max_tokens must be an integer of at least 1 "
        "or None, got '5M'"
    ]


def test_a_source_too_small_for_the_layout_is_named(parts, tokenizer):
    """Of 20, 12 and 16 documents in blocks of 6, only code's make fewer blocks than 3 ranks."""
    with pytest.raises(DataError, match=r"^mixture source 'code': 12 documents make 2 block"):
        MixedLoader(mixture(parts, {"web": 1, "code": 1, "books": 1}), tokenizer, SEQ, 1,
                    dp_size=3, block_size=6)  # fmt: skip


def test_a_negative_seed_is_refused(parts, tokenizer):
    spec = [MixtureSource("web", ArrowSource(parts["web"]), 1)]
    with pytest.raises(DataError, match=r"seed must be an integer of 0 or more, got -1"):
        MixedLoader(spec, tokenizer, SEQ, 1, seed=-1)


def test_stats_show_the_composition_and_a_plan_after_the_caps(
    parts, tokenizer, tokenizer_path, tmp_path, capsys
):
    import json

    from hlat_data.cli import main

    toml = tmp_path / "mixture.toml"
    toml.write_text(
        "".join(
            f'[[sources]]\nname = "{name}"\npaths = ["{parts[name]}"]\nweight = {weight}\n{extra}\n'
            for name, weight, extra in (
                ("web", 1, "epochs = 1"),
                ("code", 1, ""),
                ("books", 2, "max_tokens = 500"),
            )
        )
    )
    # the tokens the loader reads: each document's and its EOS
    sizes = {
        name: sum(
            len(t) + 1
            for t in tokenizer.encode_batch(ArrowSource(path).texts(range(len(ArrowSource(path)))))
            if t
        )
        for name, path in parts.items()
    }
    planned = 4 * sum(sizes.values())
    assert main(["stats", "--mixture", str(toml), "--tokenizer", tokenizer_path,
                 "--planned-tokens", str(planned)]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    shown = result["sources"]
    assert {n: shown[n]["tokens"] for n in sizes} == sizes
    assert [shown[n]["weight"] for n in ("web", "code", "books")] == [0.25, 0.25, 0.5]
    # books ends at its 500 tokens and web after one epoch; code gives the rest
    assert shown["books"]["planned_tokens"] == 500 and shown["books"]["ends_early"]
    assert shown["web"]["planned_tokens"] == sizes["web"] and shown["web"]["epochs"] == 1.0
    assert shown["code"]["planned_tokens"] == planned - 500 - sizes["web"]
    assert not shown["code"]["ends_early"] and result["unmet_tokens"] == 0
    toml.write_text(
        toml.read_text().replace(
            'weight = 1\n\n[[sources]]\nname = "books"', 'wieght = 1\n\n[[sources]]\nname = "books"'
        )
    )
    assert main(["stats", "--mixture", str(toml), "--tokenizer", tokenizer_path]) == 2
    assert "unknown keys ['wieght']" in capsys.readouterr().err
