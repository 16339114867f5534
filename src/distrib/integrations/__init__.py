"""Keras 3 on the torch backend (``KERAS_BACKEND=torch``) under distrib's strategies: Keras models as the modules a
strategy distributes (:mod:`~distrib.integrations.keras_models`), the Keras optimizers, metrics and losses a step
names (:mod:`~distrib.integrations.keras_objects`) and Keras' ``keras.distribution`` as a
``MeshStrategy`` (:mod:`~distrib.integrations.keras_distribution`). Keras is imported only once the user's code has,
so ``import distrib`` needs none of it."""
