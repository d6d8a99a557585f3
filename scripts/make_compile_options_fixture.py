#!/usr/bin/env python3
"""Write runtime/tests/fixtures/compile_options.json: `CompileOptionsProto`
bytes as the `protobuf` package serializes them.

`runtime/src/compile_options.rs` encodes the message by hand; its test
(`runtime/tests/compile_options_fixture.rs`) builds the same options and
compares bytes with these. The schema below is our own, written for this
check: only the fields hlo-train sets, under XLA's field numbers
(`xla/pjrt/proto/compile_options.proto`, `xla/xla_data.proto`):

    syntax = "proto2";
    message ComputationDevice { repeated int64 replica_device_ids = 1; }
    message DeviceAssignmentProto {
      optional int32 replica_count = 1;
      optional int32 computation_count = 2;
      repeated ComputationDevice computation_devices = 3;
    }
    message ExecutableBuildOptionsProto {
      optional int64 device_ordinal = 1;
      optional int64 num_replicas = 4;
      optional int64 num_partitions = 5;
      optional bool use_spmd_partitioning = 6;
      optional DeviceAssignmentProto device_assignment = 9;
      optional bool use_shardy_partitioner = 19;
    }
    message OptionOverrideProto {
      oneof value {
        string string_field = 1;
        bool bool_field = 2;
        int64 int_field = 3;
        double double_field = 4;
      }
    }
    message CompileOptionsProto {
      optional ExecutableBuildOptionsProto executable_build_options = 3;
      map<string, OptionOverrideProto> env_option_overrides = 7;
    }

XLA's file is proto3; ours is proto2 because the wire format is the same
and proto2 serializes what we set even at its default value (our encoder
always writes these fields: an empty message makes XLA abort) and writes
repeated integers unpacked, as our encoder does (parsers take both forms).

Map entries have no order on the wire; the bytes are serialized with
`deterministic=True`, which sorts them by key, as our encoder does.

The descriptor is built with `descriptor_pb2` (no protoc needed). Uses
the `protobuf` package from .plugins/python (where `make test` installs
it), installing it there when missing:

    python3 scripts/make_compile_options_fixture.py
"""

import json
import os
import sys

from site_packages import import_installed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "runtime", "tests", "fixtures", "compile_options.json")
PACKAGE = "hlo_train_fixture"

# (name, num_partitions, spmd, device ids or None, [(KEY=VALUE, kind)]).
# A key given twice keeps its last value, as a map does.
CASES = [
    ("default", 1, False, None, []),
    ("spmd_8", 8, True, None, []),
    (
        "spmd_8_with_every_kind_of_override",
        8,
        True,
        None,
        [
            ("xla_cpu_enable_fast_math=false", "bool"),
            ("xla_gpu_enable_triton_gemm=true", "bool"),
            ("xla_gpu_autotune_level=0", "int"),
            ("xla_b_negative=-5", "int"),
            ("xla_big=9000000000", "int"),
            ("xla_dump_to=/tmp/hlo dump", "str"),
            ("xla_empty=", "str"),
            ("xla_ratio=0.25", "double"),
            ("xla_small=-1e-3", "double"),
            ("xla_b_negative=-6", "int"),
        ],
    ),
    (
        "device_assignment_with_an_override",
        2,
        True,
        [0, 2048],
        [("--xla_gpu_enable_latency_hiding_scheduler=true", "bool")],
    ),
]


def import_protobuf():
    import_installed("google.protobuf.descriptor_pb2", ["protobuf>=6.31.1,<8"], deps=False, purge=("google",))
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    return descriptor_pb2, descriptor_pool, message_factory


def schema(descriptor_pb2):
    """The FileDescriptorProto of the schema in this file's docstring."""
    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="hlo_train_compile_options_fixture.proto", package=PACKAGE, syntax="proto2")

    def message(name, fields, nested=None):
        m = file.message_type.add(name=name)
        for f in fields:
            add_field(m, *f)
        return m

    def add_field(m, name, number, type_, label=F.LABEL_OPTIONAL, type_name=None, oneof=None):
        f = m.field.add(name=name, number=number, type=type_, label=label)
        if type_name:
            f.type_name = f".{PACKAGE}.{type_name}"
        if oneof is not None:
            f.oneof_index = oneof
        return f

    rep = F.LABEL_REPEATED
    message("ComputationDevice", [("replica_device_ids", 1, F.TYPE_INT64, rep)])
    message("DeviceAssignmentProto", [
        ("replica_count", 1, F.TYPE_INT32),
        ("computation_count", 2, F.TYPE_INT32),
        ("computation_devices", 3, F.TYPE_MESSAGE, rep, "ComputationDevice"),
    ])
    message("ExecutableBuildOptionsProto", [
        ("device_ordinal", 1, F.TYPE_INT64),
        ("num_replicas", 4, F.TYPE_INT64),
        ("num_partitions", 5, F.TYPE_INT64),
        ("use_spmd_partitioning", 6, F.TYPE_BOOL),
        ("device_assignment", 9, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, "DeviceAssignmentProto"),
        ("use_shardy_partitioner", 19, F.TYPE_BOOL),
    ])
    override = message("OptionOverrideProto", [])
    override.oneof_decl.add(name="value")
    for name, number, type_ in [("string_field", 1, F.TYPE_STRING), ("bool_field", 2, F.TYPE_BOOL),
                                ("int_field", 3, F.TYPE_INT64), ("double_field", 4, F.TYPE_DOUBLE)]:
        add_field(override, name, number, type_, oneof=0)
    options = message("CompileOptionsProto", [
        ("executable_build_options", 3, F.TYPE_MESSAGE, F.LABEL_OPTIONAL,
         "ExecutableBuildOptionsProto"),
        ("env_option_overrides", 7, F.TYPE_MESSAGE, rep,
         "CompileOptionsProto.EnvOptionOverridesEntry"),
    ])
    # A map field is a repeated message of this entry type (key 1, value 2).
    entry = options.nested_type.add(name="EnvOptionOverridesEntry")
    entry.options.map_entry = True
    add_field(entry, "key", 1, F.TYPE_STRING)
    add_field(entry, "value", 2, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, "OptionOverrideProto")
    return file


def typed(text, kind):
    """The oneof field and value of an override written KEY=VALUE."""
    key, value = text.lstrip("-").split("=", 1)
    field, v = {
        "bool": ("bool_field", lambda: {"true": True, "false": False}[value]),
        "int": ("int_field", lambda: int(value)),
        "double": ("double_field", lambda: float(value)),
        "str": ("string_field", lambda: value),
    }[kind]
    return key, field, v()


def encode(classes, n, spmd, ids, overrides):
    msg = classes["CompileOptionsProto"]()
    build = msg.executable_build_options
    build.device_ordinal = -1
    build.num_replicas = 1
    build.num_partitions = n
    build.use_spmd_partitioning = spmd
    if ids is not None:
        assignment = build.device_assignment
        assignment.replica_count = 1
        assignment.computation_count = len(ids)
        for i in ids:
            assignment.computation_devices.add().replica_device_ids.append(i)
    build.use_shardy_partitioner = spmd
    for text, kind in overrides:
        key, field, value = typed(text, kind)
        entry = msg.env_option_overrides[key]
        entry.Clear()  # a key given again replaces its value
        setattr(entry, field, value)
    return msg.SerializeToString(deterministic=True)


def main():
    descriptor_pb2, descriptor_pool, message_factory = import_protobuf()
    pool = descriptor_pool.DescriptorPool()
    pool.Add(schema(descriptor_pb2))
    classes = {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        for name in ["CompileOptionsProto"]
    }
    cases = []
    for name, n, spmd, ids, overrides in CASES:
        cases.append({
            "name": name,
            "num_partitions": n,
            "spmd": spmd,
            "device_assignment": ids,
            "overrides": [{"text": t, "kind": k} for t, k in overrides],
            "hex": encode(classes, n, spmd, ids, overrides).hex(),
        })
    import google.protobuf
    doc = {
        "made_by": "scripts/make_compile_options_fixture.py",
        "protobuf": google.protobuf.__version__,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {os.path.relpath(OUT, ROOT)}")


if __name__ == "__main__":
    main()
