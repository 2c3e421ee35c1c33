"""What the network is: model providers, looked up by name in :mod:`model_providers.registry`."""
