// A naive rung that does not compile, kept so that the grader's test can show what a learner
// sees then: the compiler's message, then "did not build", exit 1.
// tools/exercise check naive exercises/broken/naive_does_not_compile.h must fail, saying so.
#pragma once

this is not C++;
