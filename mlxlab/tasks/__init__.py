"""Task experiments: a task is a package here that holds all of itself (its settings, data,
scoring, evaluation, report and command verbs) and registers with `mlxlab.registry` when
imported: its train `task` options and its `data` / `eval` verbs. Nothing outside a task's
package imports it."""
