//! NVML telemetry. Every field is optional: inside VMs some counters report NotSupported, and without
//! libnvidia-ml nothing is available; nothing here panics.

use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::Nvml;

/// One reading of the GPU's state.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Reading {
    pub gpu: Option<String>,
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    pub max_sm_clock_mhz: Option<u32>,
    pub power_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    pub temp_c: Option<u32>,
    pub throttle_reasons: Option<String>,
    pub driver: Option<String>,
}

/// An NVML handle for one device index, if NVML loads.
pub struct Telemetry {
    nvml: Option<Nvml>,
    index: u32,
}

impl Telemetry {
    pub fn new(index: u32) -> Telemetry {
        Telemetry {
            nvml: Nvml::init().ok(),
            index,
        }
    }

    pub fn available(&self) -> bool {
        self.nvml.is_some()
    }

    pub fn read(&self) -> Reading {
        let Some(nvml) = &self.nvml else {
            return Reading::default();
        };
        let Ok(d) = nvml.device_by_index(self.index) else {
            return Reading::default();
        };
        Reading {
            gpu: d.name().ok(),
            sm_clock_mhz: d.clock_info(Clock::SM).ok(),
            mem_clock_mhz: d.clock_info(Clock::Memory).ok(),
            max_sm_clock_mhz: d.max_clock_info(Clock::SM).ok(),
            power_w: d.power_usage().ok().map(|mw| mw as f64 / 1000.0),
            power_limit_w: d.enforced_power_limit().ok().map(|mw| mw as f64 / 1000.0),
            temp_c: d.temperature(TemperatureSensor::Gpu).ok(),
            throttle_reasons: d.current_throttle_reasons().ok().map(|r| format!("{r:?}")),
            driver: nvml.sys_driver_version().ok(),
        }
    }
}
