"""TensorFlow internals of the TF writers: statistics kernels, the packed whole-model function, histogram bins,
the Keras capture hooks, shard merges, row names and every private TF/Keras access (``compat``). Users import
``tb_gradhealth.summary``, ``keras``, ``tpu``, ``distribute``, ``accumulate`` and ``tf_origin`` instead."""
