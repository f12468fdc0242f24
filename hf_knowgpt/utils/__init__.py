"""What the rest of the package stands on and nothing model-specific: user errors (`errors`), lazy package
namespaces (`lazy`), checkpoint folders on disk (`checkpoints`), model cards (`model_card`), the Hub
upload (`hub`) and a command's phases (`timeline`). Nothing here imports the model or the training and
analysis packages."""
