"""Weight quantizers. Each method is one module with pure math and one Stage; its config model
(torch-free, quantizers/configs.py) and its plugin object (compress.plugin_types.QuantMethod, in the torch-free
quantizers/plugin.py) are registered by one entry of ``compress.plugins.QUANT_METHODS``. Importing
this package imports no torch.
"""
