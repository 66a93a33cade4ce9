//! GPU state at measurement time. Filling it (NVML) belongs to the GPU runtime; this is the data.

use serde::{Deserialize, Serialize};

/// GPU name, clocks, power and temperature read next to a measurement. `None` = not available.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Telemetry {
    /// Device name as the driver reports it, e.g. "NVIDIA H200".
    pub gpu: String,
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    /// Board power draw in watts.
    pub power_w: Option<f64>,
    /// GPU core temperature in degrees Celsius.
    pub temp_c: Option<u32>,
}
