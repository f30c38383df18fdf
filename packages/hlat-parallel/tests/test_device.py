"""The device a rank computes on, the backend `auto` chooses, and the errors before any work."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from hlat_parallel import (
    DeviceError,
    ParallelConfigError,
    check_device,
    compile_backend_for,
    dist_backend_for,
    init_parallel,
    resolve_device,
)
from hlat_parallel.device import accelerator, choose_backend, instance_type


def test_auto_and_cpu_are_always_usable():
    check_device("auto")
    check_device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    found = accelerator()
    assert resolve_device("auto").type == (found.type if found else "cpu")


def test_a_device_torch_lacks_names_what_to_install():
    with pytest.raises(DeviceError, match="torch-neuronx") as error:
        check_device("neuron")
    assert "trn2" in str(error.value) and "parallel.backend = 'neuron'" in str(error.value)
    with pytest.raises(DeviceError, match="'tpu7'"):
        check_device("tpu7")
    with pytest.raises(DeviceError, match="holds no data"):
        check_device("meta")


def test_a_known_device_without_hardware_is_refused():
    if accelerator() is not None and accelerator().type == "cuda":
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(DeviceError, match="not available") as error:
        check_device("cuda:0")
    assert "CUDA build of torch" in str(error.value)


def test_a_registered_device_without_hardware_is_not_mistaken_for_a_missing_plugin():
    # A fresh process registers "neuron" as torch's PrivateUse1 name, as TorchNeuron does,
    # but has no runtime behind it: the error is about availability, not installation.
    code = textwrap.dedent(
        """
        import torch
        torch.utils.rename_privateuse1_backend("neuron")
        from hlat_parallel import DeviceError, check_device
        try:
            check_device("neuron")
        except DeviceError as e:
            print(e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "device 'neuron' is not available" in out and "no device of that type" not in out


def test_process_group_and_compile_backends_follow_the_device():
    assert dist_backend_for(torch.device("cpu")) == "gloo"
    assert dist_backend_for(torch.device("cuda", 0)) == "nccl"
    assert dist_backend_for(torch.device("cpu"), "mpi") == "mpi"  # asked for: kept
    assert compile_backend_for(torch.device("cpu")) == "inductor"
    assert compile_backend_for(torch.device("cuda")) == "inductor"


def test_auto_backend_takes_the_native_path_on_trn2_and_trn3():
    choice = choose_backend("neuron", nxd_available=True, instance="trn2.48xlarge")
    assert choice.backend == "torch" and "TorchNeuron" in choice.reason
    assert choose_backend("neuron", nxd_available=False, instance="trn3.48xlarge").backend == (
        "torch"
    )
    with pytest.raises(DeviceError, match=r"trn2\.48xlarge.*native"):
        choose_backend(None, nxd_available=False, instance="trn2.48xlarge")


def test_auto_backend_takes_the_legacy_nxd_path_on_trn1():
    choice = choose_backend(None, nxd_available=True, instance="trn1.32xlarge")
    assert choice.backend == "neuron" and "trn1" in choice.reason
    with pytest.raises(DeviceError, match=r"trn1\.32xlarge.*NeuronX Distributed"):
        choose_backend(None, nxd_available=False, instance="trn1.32xlarge")


@pytest.mark.parametrize(
    ("instance", "generation"),
    [
        ("trn1.2xlarge", "trn1"),
        ("trn1.32xlarge", "trn1"),
        ("trn1n.32xlarge", "trn1"),
        ("trn2.48xlarge", "trn2"),
        ("trn2u.48xlarge", "trn2"),
        ("trn3.48xlarge", "trn3"),
    ],
)
def test_each_trainium_family_takes_its_generations_path(instance, generation):
    if generation == "trn1":
        choice = choose_backend(None, nxd_available=True, instance=instance)
        assert choice.backend == "neuron" and instance in choice.reason
        with pytest.raises(DeviceError, match=rf"{instance}.*NeuronX Distributed"):
            choose_backend(None, nxd_available=False, instance=instance)
    else:
        assert choose_backend("neuron", nxd_available=True, instance=instance).backend == "torch"
        with pytest.raises(DeviceError, match=rf"{instance}.*native"):
            choose_backend(None, nxd_available=True, instance=instance)


def test_auto_backend_is_native_on_gpus_and_cpus():
    assert choose_backend("cuda", nxd_available=False, instance="p5.48xlarge").backend == "torch"
    assert choose_backend(None, nxd_available=False).backend == "torch"
    assert choose_backend("cpu", nxd_available=False).reason.startswith("native path on cpu")


def test_an_explicit_cpu_device_takes_the_native_path_where_nxd_imports():
    # device="cpu" asks for the CPU: NxD importing, or a Trainium instance, does not turn
    # it into the legacy XLA path (or a refusal to run without TorchNeuron)
    for instance in (None, "m7i.large", "trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge"):
        for nxd in (True, False):
            choice = choose_backend("cpu", nxd_available=nxd, instance=instance)
            assert choice.backend == "torch", (instance, nxd, choice)
            assert choice.reason.startswith("native path on cpu"), choice.reason
    # device="auto" with no accelerator registered (None) still takes NxD's legacy path
    assert choose_backend(None, nxd_available=True).backend == "neuron"


def test_instance_type_comes_from_the_dmi_product_name(tmp_path):
    (tmp_path / "product_name").write_text("trn1.32xlarge\n")
    assert instance_type(str(tmp_path / "product_name")) == "trn1.32xlarge"
    assert instance_type(str(tmp_path / "absent")) is None


def test_init_parallel_refuses_a_missing_device_before_any_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ParallelConfigError, match="torch-neuronx"):
        init_parallel(device="neuron")
    assert not dist.is_initialized()
