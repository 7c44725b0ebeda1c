"""Helpers that tests of more than one folder share (``tests/`` is on ``sys.path``, so they are
imported as ``_support.MODULE``; worker processes import the datasets by that name too).

* :mod:`_support.compare`: exact comparison (:func:`~_support.compare.assert_same`, torch as
  the oracle of the differential tests), :func:`~_support.compare.canon` (a batch as a hashable
  value), outcomes of calls that may raise, the Hypothesis settings profile, datasets written
  once for both libraries.
* :mod:`_support.strategies`: Hypothesis strategies for samples (nested containers of tensors,
  arrays and scalars).
* :mod:`_support.processes`: worker kinds (:class:`~_support.processes.Kind`, ``FAST``,
  ``PROCESSES`` (fork and forkserver), ``ALL``), the process tree below this one, polling,
  file descriptors and mappings of this process, live ferry threads.
* :mod:`_support.fixtures`: the ``kind`` and ``no_leftovers`` fixtures, imported by the
  ``conftest.py`` of ``workers/``, ``faults/`` and ``resume/``.
* :mod:`_support.datasets`: module-level datasets, collate functions and worker_init_fns
  (picklable by reference for spawn and forkserver workers).
* :mod:`_support.resume`: :func:`~_support.resume.resume_at_midpoint` and
  :func:`~_support.resume.assert_resumes_exactly`: interrupt a loader mid-epoch, resume a
  fresh one from its state, compare with the uninterrupted run.
* :mod:`_support.ranks`: starting and stopping the rank processes of multi-process tests
  (``distributed/``, ``ecosystem/``).

Helpers of one folder stay there (``workers/differential.py``, ``resume/datasets.py``,
``compat/phrases.py``, ``ecosystem/_injection.py``, ...); the fixtures every test uses are in
``tests/conftest.py``.
"""
