"""A plugin module whose own import fails (a dependency missing), for tests/test_plugins.py."""

import no_such_dependency_for_isthmus_tests  # noqa: F401

from strategies.fedavg import FedAvg as Fine  # noqa: F401
