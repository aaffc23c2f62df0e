"""sglang-jax's own bugs, one patch each (``portable_spec.integrations.sglang_jax.fixes``), each
removable on its own: a revision entry that no longer has a bug (its target omitted, or the bug
named in ``fixed`` where the mask work patches the same function) installs every other patch,
and sglang-jax's own behaviour comes back for that bug alone."""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("sgl_jax")

import _sgl as S
from test_grammar_state import scheduler_grammars
from test_verify import run_sample

from portable_spec.integrations import sglang_jax as integration
from portable_spec.integrations.patching import PatchSet, Revision, resolve
from portable_spec.integrations.sglang_jax import fixes, internals, patches

KNOWN = "cddbf6f1"
LABEL = "sglang-jax with the bug fixed"
BUGS = sorted({p.fixes for p in fixes.FIXES})


def without(bug: str) -> PatchSet:
    """The integration's table on a revision that fixed ``bug``, as its entry would say it."""
    known = internals.REVISIONS[KNOWN]
    sources, fixed = dict(known.sources), set(known.fixed)
    for patch in fixes.FIXES:
        if patch.fixes != bug:
            continue
        others = [p for p in patches.PATCHES if p.target == patch.target and p.fixes != bug]
        if others:  # the mask work patches this function too: name the bug
            fixed.add(bug)
        else:  # nothing else patches it: the entry no longer lists it
            sources.pop(patch.target, None)
    return PatchSet(
        "sglang-jax",
        patches=patches.PATCHES,
        revisions={LABEL: Revision("", sources, frozenset(fixed))},
        version=lambda: "0.0.0.dev0",
        logger=logging.getLogger("sgl_jax.portable_spec"),
    )


@pytest.fixture
def installed_without():
    integration.uninstall()
    sets = []

    def install(bug: str) -> PatchSet:
        patch_set = without(bug)
        assert patch_set.install()
        sets.append(patch_set)
        return patch_set

    yield install
    for patch_set in sets:
        patch_set.uninstall()


def patched(target: str) -> bool:
    return hasattr(resolve(target)[2], "__portable_spec_original__")


def test_every_fix_names_an_entry_and_every_bug_has_a_patch():
    assert all(p.fixes for p in fixes.FIXES)
    assert not any(p.fixes for p in patches.MASKS)
    assert len(BUGS) == 5


@pytest.mark.parametrize("bug", BUGS)
def test_a_revision_without_the_bug_leaves_only_its_patches_out(installed_without, bug):
    patch_set = installed_without(bug)
    left_out = [p for p in patches.PATCHES if p not in patch_set.installs(LABEL)]
    assert left_out == [p for p in fixes.FIXES if p.fixes == bug]
    for patch in patches.PATCHES:
        stack = [p for p in patch_set.installs(LABEL) if p.target == patch.target]
        assert patched(patch.target) == bool(stack), patch.target
    patch_set.uninstall()
    assert not any(patched(p.target) for p in patches.PATCHES)


def test_without_the_list_fix_a_list_raises_again_and_the_masks_stay(installed_without):
    installed_without(fixes.ACCEPT_LIST_BUG)
    g = S.grammar("json", S.encode("{"))
    with pytest.raises(TypeError):
        g.accept_token(S.encode('"name'))
    assert patched(fixes.TREE_PATH.target)  # sample: the mask and the tree fix


def test_without_the_tree_fix_trees_commit_predicts_first_slots_masked(installed_without):
    case = S.build_case(["json", "regex", None, "ebnf"], _prefixes(), 4, 3, 8, seed=3)
    logits = [S.logits_for(case, seed) for seed in (11, 12, 13)]
    assert integration.install()
    integration.reset_stats()
    fixed = [run_sample(case, x) for x in logits]
    integration.uninstall()
    installed_without(fixes.TREE_BUG)
    integration.reset_stats()
    unfixed = [run_sample(case, x) for x in logits]
    assert integration.integration_stats()["masked_steps"] == len(logits)  # still masked
    assert fixed != unfixed
    for got, want in zip(unfixed, fixed, strict=True):  # the same lengths, other tokens
        assert [len(t) for t in got] == [len(t) for t in want]


def test_without_the_shared_grammar_fix_cache_hits_share_one_object(installed_without):
    from sgl_jax.srt.constrained.llguidance_backend import get_guidance_backend

    installed_without(fixes.SHARED_BUG)
    backend = get_guidance_backend(tokenizer=S.hf_tokenizer(), n_vocab=S.VOCAB, num_threads=1)
    grammars = scheduler_grammars(backend, S.GRAMMARS["json"])
    assert grammars[2].ll_matcher is grammars[3].ll_matcher  # sglang-jax's own


def test_without_the_row_fix_rows_without_a_grammar_stay_as_sglang_jax_leaves_them(
    installed_without,
):
    from sgl_jax.srt.managers.schedule_batch import ModelWorkerSamplingInfo

    def rows(info_grammars):
        info = ModelWorkerSamplingInfo.__new__(ModelWorkerSamplingInfo)
        info.__dict__.update(
            grammars=info_grammars, vocab_size=S.VOCAB, vocab_mask=None, temperatures=np.ones(2)
        )
        info.update_grammar_vocab_mask()
        return np.asarray(info.vocab_mask)

    grammars = [S.grammar("json"), None]
    assert integration.install()
    fixed = rows(grammars)
    integration.uninstall()
    installed_without(fixes.ROWS_BUG)
    unfixed = rows(grammars)
    assert (fixed[1] == -1).all() and not (unfixed[1] == -1).all()
    assert (fixed[0] == unfixed[0]).all()


def _prefixes() -> list[list[int]]:
    return [S.encode('{"name": "'), S.encode("20"), [28, 29], S.encode("{")]
