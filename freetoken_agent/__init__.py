"""freetoken-agent: a local runtime for large Mixture-of-Experts models under coding agents.

Contract: `__version__` is the package version (pyproject.toml reads it from here). Importing the
package imports nothing else: the command line (`freetoken_agent.cli`) loads torch and the engine
only for the commands that run a model.
"""

__version__ = "0.1.0"
