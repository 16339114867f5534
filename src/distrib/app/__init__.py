"""The `distrib train` application: the tutorials' Fashion-MNIST CNN, its data, its training job, the CLI."""
