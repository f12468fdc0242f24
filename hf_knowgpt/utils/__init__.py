"""What the rest of the package stands on and nothing model-specific: user errors (`errors`), lazy package
namespaces (`lazy`), checkpoint folders on disk (`checkpoints`), model cards (`model_card`), the Hub
upload (`hub`), a command's phases (`timeline`) and a CUDA context made while a command imports
(`cuda_context`). Nothing here imports the model or the training and analysis packages."""
