"""The engine's program count in tests: a check that nothing compiles is only as good as the
listener behind the count, so each such check also shows the count rise when programs do
compile."""

import jax

from specjax.sampling import engine as eng


def assert_the_count_rises_when_programs_compile(run) -> None:
  """`run()` after every compiled program is dropped (it compiles them again, or loads them from
  the persistent compilation cache) raises the engine's program count."""
  jax.clear_caches()
  before = eng.compiled_programs()
  jax.block_until_ready(run())
  assert eng.compiled_programs() > before, "the program count did not rise: it sees no compile"
