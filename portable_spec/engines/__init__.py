"""Grammar engines: one module per engine, each with the same three jobs.

* learn what the builder needs about a matcher without moving it (``probe``: its bitmask
  width, its stop tokens, limits such as a rollback depth), cached per matcher object;
* fill the rows of one request's verify tree (or a whole batch, where the engine has a
  parallel fill of its own) and leave every matcher in the state it started in;
* keep one request's grammar state at the live nodes of a draft tree that grows level by
  level (its :class:`~portable_spec.engines.base.NodeStates`, for
  :class:`portable_spec.DraftSession`).

=================  ===========================================================================
module             matchers
=================  ===========================================================================
``xgrammar``       ``xgrammar.GrammarMatcher``: C++ ``traverse_draft_tree``, GIL released by
                   the compiled helper
``llguidance``     ``llguidance.LLMatcher``: the tree cut into chains, filled by llguidance's
                   Rust executor in one parallel call
``outlines``       ``outlines_core.Guide``: iterative walk with ``advance``/``rollback_state``
``generic``        anything following :class:`portable_spec.GrammarMatcherLike`
=================  ===========================================================================

Draft states by engine: xgrammar, llguidance and protocol matchers with a faithful ``fork()``
keep one fork per live node (a level costs fork + accept + fill per new node; the session's
matcher never moves); protocol matchers without forks and outlines-core guides move their one
matcher along root paths (``sum(depth of the level's parents)`` accepts and rollbacks on top
of one accept + fill per new node; the matcher is back at its start before each call
returns). ``base.py`` holds what every engine shares, ``walk.py`` the iterative walk and the
path replay.

No module here imports its engine: a caller holding an engine's matcher has imported it.
"""
