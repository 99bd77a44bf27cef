"""What the tests share: tiny models and runs, log writers, real servers and receivers, the
checkout's paths. Test modules import from here, never from each other or from conftest."""
