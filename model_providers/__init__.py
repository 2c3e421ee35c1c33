"""What the network is: one package per model family (``glm5``), each with the network itself
(``model/``), counting without building it (``counting/``) and its Hugging Face tool (``hf/``).
The run config's ``model`` group names the family's config; there is one family today, so there
is no lookup by name."""
