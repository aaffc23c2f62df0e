"""Grammar engines: one module per engine, each with the same two jobs.

* learn what the builder needs about a matcher without moving it (``probe``: its bitmask
  width, its stop tokens, limits such as a rollback depth), cached per matcher object;
* fill the rows of one request's verify tree (or a whole batch, where the engine has a
  parallel fill of its own) and leave every matcher in the state it started in.

=================  ===========================================================================
module             matchers
=================  ===========================================================================
``xgrammar``       ``xgrammar.GrammarMatcher``: C++ ``traverse_draft_tree``, GIL released
``llguidance``     ``llguidance.LLMatcher``: the tree cut into chains, filled by llguidance's
                   Rust executor in one parallel call
``outlines``       ``outlines_core.Guide``: iterative walk with ``advance``/``rollback_state``
``generic``        anything following :class:`portable_spec.GrammarMatcherLike`
=================  ===========================================================================

No module here imports its engine: a caller holding an engine's matcher has imported it.
"""
